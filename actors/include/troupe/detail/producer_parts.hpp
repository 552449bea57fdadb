// What a job's typed producer (typed_producer.hpp) uses besides the interfaces: a device's
// one shared device_state, and the producer's side of a chunk's cut (claims in grabs).
#pragma once

#include "troupe/detail/ops_base.hpp"

namespace troupe::detail {

/// Holds a job's device_state (void: none).
template <class S>
struct device_state_holder {
  explicit device_state_holder(const device& d, const config& cfg) : state(d, cfg) {}
  S state;
};
template <>
struct device_state_holder<void> {};

/// The device_state `S` of device `d` and config `cfg` in this process: made (on the calling
/// producer's thread, bound to `d`) by the first producer of `d` that asks, shared by the others
/// with the same config while any holds it, destroyed when the last lets go. Producers of `d`
/// constructed at once wait for the first; those of other devices do not (each device's model
/// loads at the same time). A construction that throws is not tried again by the producers that
/// waited for it: they fail with its exception (each would have taken the load's time again).
template <class S>
std::shared_ptr<device_state_holder<S>> device_state_for(const device& d, const config& cfg) {
  struct made {
    config cfg;
    std::weak_ptr<device_state_holder<S>> state;
  };
  struct entry {
    std::mutex making;
    std::vector<made> states;                ///< under `making`
    std::atomic<std::uint64_t> finished{0};  ///< constructions that returned or threw
    std::uint64_t failed_at = 0;             ///< under `making`: `finished` at the last throw
    config failed_cfg;
    std::exception_ptr failure;
  };
  static std::mutex mtx;
  // Never destroyed: producers on their threads may still let go of their state during exit().
  // One entry per device the process has used (`cuda` is `cuda:0`, as bind() takes it).
  static auto& live = *new std::map<std::string, std::unique_ptr<entry>>;
  entry* e = nullptr;
  {
    std::lock_guard<std::mutex> guard{mtx};
    auto key = d.str();
    if (d.is_cuda() && d.index() < 0) key += ":0";
    auto& slot = live[key];
    if (!slot) slot = std::make_unique<entry>();
    e = slot.get();
  }
  // Constructions over before this producer came: one that fails after it is what it waited for.
  auto seen = e->finished.load();
  std::lock_guard<std::mutex> guard{e->making};
  // Another config is another state (two runners of one job type serving two models): sharing
  // by device alone gave a runner another runner's model.
  for (auto& m : e->states)
    if (m.cfg == cfg)
      if (auto h = m.state.lock()) return h;
  if (e->failure && e->failed_at > seen && e->failed_cfg == cfg) std::rethrow_exception(e->failure);
  try {
    auto h = std::make_shared<device_state_holder<S>>(d, cfg);
    ++e->finished;
    e->states.erase(std::remove_if(e->states.begin(), e->states.end(),
                                   [](const made& m) { return m.state.expired(); }),
                    e->states.end());
    e->states.push_back(made{cfg, h});
    return h;
  } catch (...) {
    e->failure = std::current_exception();
    e->failed_at = ++e->finished;
    e->failed_cfg = cfg;
    throw;
  }
}

/// A producer's side of a chunk_cut: the chunk's items claimed in grabs of about two
/// microseconds of work (an atomic exchange each, a clock read each), and between grabs' checks
/// the scheduler's request for claimed items looked at every few items (a relaxed load), so that
/// a grab of items that turn out slow is given back at once.
class cut_claims {
 public:
  /// For a chunk with cut `cut` (null: every item is the producer's).
  void start(chunk_cut* cut) noexcept {
    cut_ = cut;
    granted_ = 0;
    grab_ = 1;
    step_ = 1;
    timed_ = false;
  }
  [[nodiscard]] bool cutting() const noexcept { return cut_ != nullptr; }

  /// How many of the chunk's items from `at` (its index in the chunk: every item before it
  /// started) may start now without looking again, at most `want`; 0: the chunk ends at `at`.
  std::size_t allow(std::size_t at, std::size_t want) {
    if (cut_ == nullptr) return want;
    cut_->note_started(at);
    if (at < granted_ && !cut_->wanted()) return std::min({want, granted_ - at, step_});
    return claim_more(at, want, false);
  }
  /// The same, all `want` items at once when the cut allows (one call of a batch producer).
  std::size_t allow_all(std::size_t at, std::size_t want) {
    if (cut_ == nullptr) return want;
    cut_->note_started(at);
    return claim_more(at, want, true);
  }

 private:
  using steady = std::chrono::steady_clock;
  std::size_t claim_more(std::size_t at, std::size_t want, bool all) {
    auto now = steady::now();
    if (cut_->wanted() || at < granted_) {  // asked for claimed items: the rest of the grab
      cut_->release(at);
      granted_ = at;
      grab_ = 1;
      timed_ = false;
    } else if (timed_ && granted_ > grab_from_) {
      // The last grab's items took this long each: the next grab lasts about 2 us.
      auto ns =
          static_cast<double>(
              std::chrono::duration_cast<std::chrono::nanoseconds>(now - grab_start_).count()) /
          static_cast<double>(granted_ - grab_from_);
      auto fit = ns > 0 ? static_cast<std::size_t>(2000.0 / ns) : max_grab;
      grab_ = std::clamp<std::size_t>(fit, 1, std::min(max_grab, 2 * grab_));
    }
    step_ = std::clamp<std::size_t>(grab_ / 8, 1, 32);
    auto g = cut_->claim(all ? want : grab_);
    grab_from_ = at;
    grab_start_ = now;
    timed_ = true;
    granted_ = at + g;
    return all ? g : std::min({want, g, step_});
  }
  static constexpr std::size_t max_grab = 4096;
  chunk_cut* cut_ = nullptr;
  std::size_t granted_ = 0;  ///< items [0, granted_) are claimed
  std::size_t grab_ = 1;     ///< items the next claim asks for
  std::size_t step_ = 1;     ///< items between two looks at the scheduler's request
  std::size_t grab_from_ = 0;
  steady::time_point grab_start_{};
  bool timed_ = false;
};

}  // namespace troupe::detail
