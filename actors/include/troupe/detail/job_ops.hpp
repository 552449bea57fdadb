// The per-job code of a runner, behind two small interfaces: a producer's work loop over a
// chunk and a consumer's loop over outputs. Only this part is a template instantiated in the
// user's translation unit; the actors that drive it, the scheduler and the network code are
// compiled once, in the library.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "troupe/batch.hpp"
#include "troupe/config.hpp"
#include "troupe/detail/chunk_cut.hpp"
#include "troupe/detail/job_gate.hpp"
#include "troupe/detail/work_outcome.hpp"
#include "troupe/device.hpp"
#include "troupe/error.hpp"
#include "troupe/job.hpp"
#include "troupe/span.hpp"

namespace troupe::detail {

/// One line describing the exception in flight (LibTorch's backtraces cut off).
std::string describe_current_exception();

/// A job's producer object, constructed on its producer's thread.
class producer_ops {
 public:
  virtual ~producer_ops() = default;
  /// Runs producer::work on every item of `items` (item i has index `first + i`). `fold`
  /// (work_chunk::fold, never with keep_going): the outputs go into a consumer of the job's
  /// own, made for this chunk, handed back as a folded_chunk for the job's consumer to merge.
  /// `cut` (work_chunk::cut, or null): items are claimed there before they start, and the
  /// chunk ends where the scheduler cut it (the outcome then covers items [0, cut->end())).
  virtual void work(const batch& items, std::uint64_t first, bool keep_going, job_gate* fold,
                    work_outcome& out, chunk_cut* cut = nullptr) = 0;
  /// options::batching: the chunks `parts` (of any jobs, none lent or folded) in one call where
  /// the job's producer takes a batch (work(span)): their items concatenated, each part's
  /// outcome in outs[i]. A call that throws (or returns another number of outputs) is made
  /// again part by part, each as work() would (split down to the items that fail alone), so
  /// only the parts with such items fail; every call beyond the first is counted in
  /// extra_calls. Other producers: each part through work().
  virtual void work_parts(const std::vector<const batch*>& parts,
                          const std::vector<std::uint64_t>& firsts,
                          const std::vector<bool>& keep_going, std::vector<work_outcome>& outs) {
    for (std::size_t i = 0; i < parts.size(); ++i)
      work(*parts[i], firsts[i], keep_going[i], nullptr, outs[i]);
  }
  /// producer::end(), if the job has one.
  virtual void end() = 0;
  /// Destroys the job's producer object; its destructor may throw (and that is reported).
  virtual void destroy() = 0;
};

/// A job's consumer object for one job, constructed on the consumer's thread.
class consumer_ops {
 public:
  virtual ~consumer_ops() = default;
  /// consumer::work on every output, before each one checking that the job has not ended
  /// (`gate.stopped()`: the rest of the chunk is given up) and counting it in
  /// `gate.add_delivered()`; returns false when the batch holds another type.
  virtual bool work(batch& outputs, job_gate& gate) = 0;
  /// consumer::end(): its value is kept for job_handle::get().
  virtual void end() = 0;
  /// The consumer member work() was calling when it threw: "work", or "merge".
  [[nodiscard]] virtual const char* member() const noexcept { return "work"; }
  /// Destroys the job's consumer object; its destructor may throw.
  virtual void destroy() = 0;
};

/// Owns a job's producer or consumer object, whose destructor may throw: reset() lets that
/// through (to be reported); the owner's own destructor swallows it.
template <class T>
class throwing_owner {
 public:
  explicit throwing_owner(std::unique_ptr<T> p) : p_(p.release()) {}
  throwing_owner(const throwing_owner&) = delete;
  throwing_owner& operator=(const throwing_owner&) = delete;
  ~throwing_owner() {
    try {
      reset();
    } catch (...) {
    }
  }
  void reset() { delete std::exchange(p_, nullptr); }
  T& operator*() const noexcept { return *p_; }
  T* operator->() const noexcept { return p_; }

 private:
  T* p_;
};

/// Constructs a job's producer object on `d` (index: its position in the runner's devices).
using producer_maker = std::unique_ptr<producer_ops> (*)(const device& d, const config& cfg,
                                                         std::size_t index);
/// Constructs a job's consumer object.
using consumer_maker = std::function<std::unique_ptr<consumer_ops>(const config& cfg)>;

/// Output buffers of numbers, given back when the batch holding them is destroyed (by the
/// consumer, or once sent to a node) and taken again for the next chunk: no fresh pages to
/// fault in and no zero-fill for every chunk. Keeps a few buffers at most.
template <class T>
class buffer_pool : public std::enable_shared_from_this<buffer_pool<T>> {
 public:
  /// A buffer of at least `n` items (their values are whatever was there).
  std::vector<T> take(std::size_t n) {
    std::vector<T> v;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (!free_.empty()) {
        v = std::move(free_.back());
        free_.pop_back();
      }
    }
    v.resize(n);  // a smaller size: no fill; a larger one: only the growth is filled
    return v;
  }
  /// `items` as a batch that gives its buffer back here when it is destroyed.
  batch wrap(std::vector<T> items) {
    auto self = this->shared_from_this();
    return batch{
        std::shared_ptr<batch_base>(new batch_of<T>(std::move(items)), [self](batch_base* b) {
          auto* typed = static_cast<batch_of<T>*>(b);
          self->give(std::move(typed->items));
          delete typed;
        })};
  }

 private:
  void give(std::vector<T> v) noexcept {
    try {
      std::lock_guard<std::mutex> guard{mtx_};
      if (free_.size() < max_free) free_.push_back(std::move(v));
    } catch (...) {
    }
  }
  static constexpr std::size_t max_free = 4;
  std::mutex mtx_;
  std::vector<std::vector<T>> free_;
};

/// consumer::work on outputs [xs, xs + m), counted into `taken` (also when one throws).
template <class C, class Out>
void take(C& c, Out* __restrict xs, std::size_t m, std::size_t& taken) {
  std::size_t j = 0;
  try {
    for (; j < m; ++j) c.work(std::move(xs[j]));
  } catch (...) {
    taken += j;
    throw;
  }
  taken += j;
}

/// consumer::work on outputs [xs, xs + size), counted into `taken` (also when one throws).
/// Looks at the job's gate before every item, so that nothing of an ended job runs after the
/// consumer's current item; for a consumer whose previous run took under 100 ns per item
/// (`fast`, updated here), before every block of 64 items instead (under ~6 us of them), so
/// that its loop stays tight. The outputs are the caller's own (restrict): a consumer that sums
/// numbers into a member keeps the sum in a register and the loop is vectorized.
template <class C, class Out>
void consume_checked(C& c, Out* xs, std::size_t size, const job_gate& gate, bool& fast,
                     std::uint64_t& taken) {
  using steady = std::chrono::steady_clock;
  auto t0 = steady::now();
  std::size_t step = fast ? 64 : 1;
  std::size_t n = 0;
  struct count {  // also when work() throws: what it took before counts
    std::uint64_t& taken;
    std::size_t& n;
    ~count() { taken += n; }
  } counted{taken, n};
  while (n < size && !gate.stopped()) take(c, xs + n, std::min(step, size - n), n);
  if (size >= 64)
    fast = steady::now() - t0 < std::chrono::nanoseconds{100} * static_cast<std::int64_t>(size);
}

/// A chunk's outputs folded on its producer (work_chunk::fold): a consumer of the job's own
/// that took them, for the job's consumer to merge(). Never crosses the network.
template <class C>
class folded_chunk final : public batch_base {
 public:
  folded_chunk(std::unique_ptr<C> part, std::size_t n) : part_(std::move(part)), n_(n) {}
  /// The consumer that took the chunk's outputs (merged once, by the job's consumer).
  [[nodiscard]] C& part() const noexcept { return *part_; }
  /// Destroys that consumer now (once merged); a throw from its destructor is ignored.
  void dispose() const noexcept {
    try {
      part_.reset();
    } catch (...) {
    }
  }
  [[nodiscard]] std::size_t size() const noexcept override { return n_; }
  /// The chunk was cut short (chunk_cut): it holds the outputs of its first `n` items only.
  void cut_to(std::size_t n) noexcept { n_ = n; }
  [[nodiscard]] const std::type_info& item_type() const noexcept override {
    return typeid(folded_chunk<C>);
  }
  [[nodiscard]] std::optional<std::size_t> flat_bytes() const noexcept override {
    return sizeof(C);
  }
  caf::error save(caf::serializer&) const override {
    return caf::make_error(caf::sec::state_not_serializable);
  }
  caf::error load(caf::deserializer&) override {
    return caf::make_error(caf::sec::state_not_serializable);
  }
  [[nodiscard]] std::shared_ptr<batch_base> slice(std::size_t, std::size_t) const override {
    throw std::logic_error("a folded chunk's outputs cannot be sliced");
  }

 private:
  mutable throwing_owner<C> part_;  ///< its destructor may throw: ignored
  std::size_t n_;
};

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

template <class Job>
class typed_producer final : public producer_ops {
 public:
  using traits = job_traits<Job>;
  using in = typename traits::input_type;
  using out = typename traits::output_type;

  typed_producer(const device& d, const config& cfg, std::size_t index)
      : shared_(shared_state(d, cfg)), p_(make(d, cfg, index, shared_)), cfg_(cfg) {
    using P = typename traits::producer_type;
    // After construction, before the first chunk (this runs in the producer's init): slow first
    // calls (a TorchScript module's profiling runs, allocators) stay out of the chunks' times.
    if constexpr (has_warmup<P>::value) p_->warmup();
  }

  void work(const batch& chunk, std::uint64_t first, bool keep_going, job_gate* fold,
            work_outcome& r, chunk_cut* cut = nullptr) override {
    claims_.start(cut);
    chunk_first_ = first;
    cut_short_ = false;
    const in* x = nullptr;
    std::size_t n = 0;
    if constexpr (raw_items<in>) {
      std::tie(x, n) = chunk.template span<in>();
    } else if (auto* items = chunk.as<in>()) {
      x = items->items.data();
      n = items->items.size();
    }
    if (x == nullptr && chunk.size() != 0) {
      r.wrong_type = true;
      return;
    }
    auto* lease = chunk.lease();  // only ever for numbers: a caller's contiguous range
    if constexpr (traits::folds) {
      if (fold != nullptr && !keep_going) {
        // A folded chunk is cut as any other: items are claimed before they are folded, so
        // that none is both folded here and taken back for an idle producer.
        work_folded(*fold, lease, x, n, first, r);
        return;
      }
    }
    auto outputs = start_outputs(n);
    std::size_t k = 0;  // outputs written
    bool went_on = false;
    if constexpr (raw_items<in>)
      if (lease) went_on = work_on_lent(*lease, x, n, first, keep_going, r, outputs, k);
    if (!lease) went_on = work_on(x, n, first, keep_going, r, outputs, k);
    finish_outputs(went_on, std::move(outputs), k, r);
  }

  void work_parts(const std::vector<const batch*>& parts, const std::vector<std::uint64_t>& firsts,
                  const std::vector<bool>& keep_going, std::vector<work_outcome>& outs) override {
    if constexpr (traits::batched) {
      std::vector<in> all;
      std::vector<std::size_t> sizes;
      bool plain = true;
      for (auto* b : parts) {
        const in* x = nullptr;
        std::size_t n = 0;
        if constexpr (raw_items<in>) {
          if (!b->lease()) std::tie(x, n) = b->template span<in>();
        } else if (auto* items = b->template as<in>()) {
          x = items->items.data();
          n = items->items.size();
        }
        if (b->lease() || (x == nullptr && b->size() != 0)) {
          plain = false;
          break;
        }
        all.insert(all.end(), x, x + n);
        sizes.push_back(n);
      }
      if (plain && !all.empty()) {
        try {
          std::vector<out> ys = p_->work(span<const in>{all.data(), all.size()});
          if (ys.size() == all.size()) {
            std::size_t at = 0;
            for (std::size_t i = 0; i < parts.size(); ++i) {
              auto from = ys.begin() + static_cast<std::ptrdiff_t>(at);
              std::vector<out> mine(
                  std::make_move_iterator(from),
                  std::make_move_iterator(from + static_cast<std::ptrdiff_t>(sizes[i])));
              outs[i].outputs = batch::of(std::move(mine));
              at += sizes[i];
            }
            return;
          }
        } catch (...) {
        }
        // Part by part: only the parts whose items fail alone fail.
        for (std::size_t i = 0; i < parts.size(); ++i) {
          work(*parts[i], firsts[i], keep_going[i], nullptr, outs[i]);
          outs[i].extra_calls += 1;
        }
        return;
      }
    }
    producer_ops::work_parts(parts, firsts, keep_going, outs);
  }

  void end() override {
    if constexpr (has_end<typename traits::producer_type>::value) p_->end();
  }
  void destroy() override { p_.reset(); }

 private:
  // Numbers are written in place through local pointers (no per-item capacity check), into a
  // recycled buffer; other outputs are appended.
  static constexpr bool in_place = raw_items<out> && raw_items<in> && !traits::batched;

  std::vector<out> start_outputs(std::size_t n) {
    std::vector<out> outputs;
    if constexpr (in_place)
      outputs = pool_->take(n);
    else
      outputs.reserve(n);
    return outputs;
  }

  void finish_outputs(bool went_on, std::vector<out> outputs, std::size_t k, work_outcome& r) {
    if (!went_on) return;  // failed or revoked: no outputs
    if constexpr (in_place) {
      outputs.resize(k);
      r.outputs = pool_->wrap(std::move(outputs));  // without the failed items
    } else {
      r.outputs = batch::of(std::move(outputs));
    }
  }

  /// A part of a caller's range: read a block at a time, each copied (under the lease) into a
  /// small buffer of this producer's that stays in the core's cache, work() called on the
  /// copies; so user code never runs while the range is held, the range is read once, and a
  /// job's handle that takes the range back waits for one block's copy at most.
  bool work_on_lent(range_lease& lease, const in* x, std::size_t n, std::uint64_t first,
                    bool keep_going, work_outcome& r, std::vector<out>& outputs, std::size_t& k) {
    // A batch producer's chunk is one call whatever its size (a block per call would pay its
    // fixed cost again every 16 KiB): copied whole.
    constexpr bool whole = traits::batched;
    auto block = whole ? std::max<std::size_t>(n, 1) : lent_block;
    for (std::size_t at = 0; at < n && !cut_short_; at += block) {
      auto m = std::min(block, n - at);
      auto* copy = copy_lent_block(lease, x, at, m, n, r);
      if (copy == nullptr || !work_on(copy, m, first + at, keep_going, r, outputs, k)) return false;
    }
    return true;
  }

  /// Items [at, at + m) of a caller's range of `n` items, copied under its lease into this
  /// producer's block buffer, the next block asked into the cache meanwhile (a prefetch reads
  /// nothing: it never faults, and the lease does not cover it); nullptr (and `r.revoked`) once
  /// the job's handle has taken the range back. Inlined: a call here cost the folded x*x loop
  /// up to 10 % (troupe_ranges_bench).
  __attribute__((always_inline)) const in* copy_lent_block(range_lease& lease, const in* x,
                                                           std::size_t at, std::size_t m,
                                                           std::size_t n, work_outcome& r) {
    if (block_.size() < m) block_.resize(std::max(m, lent_block));
    if (!lease.acquire()) {
      r.revoked = true;
      return nullptr;
    }
    std::memcpy(block_.data(), x + at, m * sizeof(in));
    lease.release();
    auto* next = reinterpret_cast<const char*>(x + at + m);
    for (std::size_t o = 0; o < std::min(m, n - at - m) * sizeof(in); o += 64)
      __builtin_prefetch(next + o);
    return block_.data();
  }

  /// The chunk's outputs into a consumer of the job's own (work_chunk::fold): each output goes
  /// from producer::work straight to that consumer's work(), never stored (a part of a caller's
  /// range is copied first, a block at a time, under its lease). What it hands back is that
  /// consumer (folded_chunk), or the first failure. Nothing once the job's outputs are no longer
  /// wanted (its gate is no longer open: it ended, or consumer::end() began, so this chunk is a
  /// speculative copy that lost) or its handle took the range back; the consumer is then
  /// destroyed here (a throw from its destructor ignored).
  void work_folded(job_gate& gate, range_lease* lease, const in* x, std::size_t n,
                   std::uint64_t first, work_outcome& r) {
    using consumer_type = typename traits::consumer_type;
    if (!gate.open()) {
      r.revoked = true;
      return;
    }
    // Cut before its first item (the scheduler took it all for an idle producer): no consumer
    // is made for it, and its answer (no outputs) is dropped.
    if (n > 0 && claims_.allow(0, 1) == 0) return;
    std::shared_ptr<folded_chunk<consumer_type>> folded;
    try {
      folded = std::make_shared<folded_chunk<consumer_type>>(make_with<consumer_type>(cfg_), n);
    } catch (...) {
      r.consumer_failed = true;
      r.what =
          "consumer::consumer (constructor) threw on a producer folding a chunk for "
          "consumer::merge: " +
          describe_current_exception();
      return;
    }
    auto& part = folded->part();
    constexpr std::size_t block = raw_items<in> ? lent_block : std::size_t{256};
    // The gate before every item; every 64 once items take under 100 ns each (measured over
    // the chunk's first 64 items, then every 16384, one at a time again once they are slower).
    using steady = std::chrono::steady_clock;
    constexpr std::size_t fast_step = 64;
    std::size_t step = 1, done = 0, probe_at = fast_step, probe_from = 0;
    auto probe_start = steady::now();
    for (std::size_t at = 0; at < n; at += block) {
      auto m = std::min(block, n - at);
      const in* src = x + at;
      if constexpr (raw_items<in>) {
        if (lease && (src = copy_lent_block(*lease, x, at, m, n, r)) == nullptr) return;
      }
      for (std::size_t b = 0, k = 0; b < m; b += k) {
        if (!gate.open()) {  // no longer wanted
          r.revoked = true;
          return;
        }
        // The items that may start now (all of them without a cut); none: the scheduler took
        // the rest of the chunk for an idle producer, and it ends here.
        k = claims_.allow(at + b, std::min(step, m - b));
        if (k == 0) {
          folded->cut_to(at + b);
          n = at + b;
          break;
        }
        std::size_t j = 0;
        bool consuming = false;  // which of the two threw
        try {
          fold(part, *p_, src + b, k, j, consuming);
        } catch (...) {
          auto index = first + at + b + j;
          if (consuming) {
            r.consumer_failed = true;
            r.what =
                "consumer::work threw on a producer folding a chunk for consumer::merge "
                "(item " +
                std::to_string(index) + "): " + describe_current_exception();
          } else {
            r.failed = true;
            r.failed_index = index;
            r.what = describe_current_exception();
          }
          return;
        }
        done += k;
        if (done >= probe_at) {
          auto now = steady::now();
          auto items = static_cast<std::int64_t>(done - probe_from);
          bool fast = now - probe_start < std::chrono::nanoseconds{100} * items;
          step = fast ? fast_step : 1;
          probe_start = now;
          probe_from = done;
          probe_at = done + (fast ? 16384 : fast_step);
        }
      }
    }
    if (!gate.open()) {  // not wanted any more: destroyed here, not wherever the answer is dropped
      r.revoked = true;
      return;
    }
    r.outputs = batch{std::move(folded)};
  }

  /// consumer::work(producer::work(x)) for items [x, x + m), counting them in `j`; `consuming`
  /// says whose call was under way when one threw. The items are this producer's own copy
  /// (restrict): a consumer that sums numbers into a member keeps the sum in a register.
  static void fold(typename traits::consumer_type& c, typename traits::producer_type& p,
                   const in* __restrict x, std::size_t m, std::size_t& j, bool& consuming) {
    for (; j < m; ++j) {
      auto y = produce(p, x[j]);
      consuming = true;
      c.work(std::move(y));
      consuming = false;
    }
  }

  /// producer::work on one item, handed over as its parameter takes it (a `&&` parameter gets
  /// a fresh copy to move from).
  static decltype(auto) produce(typename traits::producer_type& p, const in& x) {
    if constexpr (std::is_rvalue_reference<typename traits::work_arg>::value)
      return p.work(in(x));
    else
      return p.work(x);
  }

  /// producer::work on items [x, x + n) (the first one has index `first`), outputs from
  /// outputs[k] on; false when an item failed the chunk.
  bool work_on(const in* x, std::size_t n, std::uint64_t first, bool keep_going, work_outcome& r,
               std::vector<out>& outputs, std::size_t& k) {
    if constexpr (traits::batched) {
      if (n == 0) return true;
      // One call for the items the cut leaves it (all of them unless the scheduler took some).
      auto m = claims_.allow_all(static_cast<std::size_t>(first - chunk_first_), n);
      if (m < n) cut_short_ = true;
      if (m == 0) return true;
      return work_on_batch(x, m, first, keep_going, r, outputs, k);
    } else {
      return work_on_items(x, n, first, keep_going, r, outputs, k);
    }
  }

  bool work_on_items(const in* x, std::size_t n, std::uint64_t first, bool keep_going,
                     work_outcome& r, std::vector<out>& outputs, std::size_t& k) {
    std::size_t i = 0;
    auto& p = *p_;
    auto at = static_cast<std::size_t>(first - chunk_first_);  // x[0]'s index in the chunk
    while (i < n) {
      // The items that may start now (all of them without a cut).
      auto m = claims_.allow(at + i, n - i);
      if (m == 0) {  // the scheduler took the rest of the chunk
        cut_short_ = true;
        return true;
      }
      std::size_t j = 0;  // items done since i
      try {
        if constexpr (in_place) {
          // A counted loop over two local pointers: vectorized where the work allows it.
          const in* src = x + i;
          out* dst = outputs.data() + k;
          for (; j < m; ++j) dst[j] = p.work(in(src[j]));
        } else {
          for (; j < m; ++j) outputs.push_back(produce(p, x[i + j]));
        }
        i += j;
        k += j;
      } catch (...) {
        i += j;
        k += j;
        if (!keep_going) {
          r.failed = true;
          r.failed_index = first + i;
          r.what = describe_current_exception();
          return false;
        }
        // The job skips or retries failed items: note this one and go on with the next.
        r.failures.push_back(item_error{first + i, describe_current_exception()});
        ++i;
      }
    }
    return true;
  }

  /// A batch producer's work(span) on items [x, x + n): one call; when it throws, the batch is
  /// split in halves and each run again, down to single items, so that only the items that
  /// fail alone fail (each counted in r.extra_calls). False when an item failed the chunk.
  bool work_on_batch(const in* x, std::size_t n, std::uint64_t first, bool keep_going,
                     work_outcome& r, std::vector<out>& outputs, std::size_t& k) {
    std::vector<out> ys;
    try {
      ys = p_->work(span<const in>{x, n});
    } catch (...) {
      if (n > 1) {
        auto half = n / 2;
        r.extra_calls += 1;  // each half's call, counted when it is made
        if (!work_on_batch(x, half, first, keep_going, r, outputs, k)) return false;
        r.extra_calls += 1;
        return work_on_batch(x + half, n - half, first + half, keep_going, r, outputs, k);
      }
      if (!keep_going) {
        r.failed = true;
        r.failed_index = first;
        r.what = describe_current_exception();
        return false;
      }
      r.failures.push_back(item_error{first, describe_current_exception()});
      return true;
    }
    if (ys.size() != n) {  // a bug in the producer: its batch's outputs cannot be matched up
      r.failed = true;
      r.failed_index = first;
      r.what = "producer::work(span) returned " + std::to_string(ys.size()) + " outputs for " +
               std::to_string(n) + " items (it must return one per item, in order)";
      return false;
    }
    for (auto& y : ys) outputs.push_back(std::move(y));
    k += n;
    return true;
  }

  /// Job::device_state of this producer's device (declared first: it outlives the producer
  /// object, and the last producer of the device destroys it).
  std::shared_ptr<device_state_holder<typename traits::device_state_type>> shared_;
  throwing_owner<typename traits::producer_type> p_;
  config cfg_;  ///< for the consumers that fold chunks (work_folded)

  using state_ptr = std::shared_ptr<device_state_holder<typename traits::device_state_type>>;
  static state_ptr shared_state(const device& d, const config& cfg) {
    (void)d;
    (void)cfg;
    if constexpr (traits::shares_state)
      return device_state_for<typename traits::device_state_type>(d, cfg);
    else
      return nullptr;
  }
  static std::unique_ptr<typename traits::producer_type> make(const device& d, const config& cfg,
                                                              std::size_t index,
                                                              const state_ptr& shared) {
    using P = typename traits::producer_type;
    (void)index;
    (void)shared;
    if constexpr (traits::shares_state)
      return std::make_unique<P>(d, cfg, shared->state);
    else
      return make_producer<P>(d, cfg, index);
  }
  /// A caller's range is read this many items at a time (16 KiB: copy_lent_block).
  static constexpr std::size_t lent_block = std::max<std::size_t>(1, 16384 / sizeof(in));
  cut_claims claims_;              ///< the current chunk's cut (work_chunk::cut)
  std::uint64_t chunk_first_ = 0;  ///< the current chunk's first index
  bool cut_short_ = false;         ///< the current chunk ended where the scheduler cut it
  std::vector<in> block_;  ///< copy_lent_block: the block of a caller's range being worked on
  std::shared_ptr<buffer_pool<out>> pool_ = std::make_shared<buffer_pool<out>>();
};

template <class Job>
std::unique_ptr<producer_ops> make_producer_ops(const device& d, const config& cfg,
                                                std::size_t index) {
  return std::make_unique<typed_producer<Job>>(d, cfg, index);
}

/// Registers the job's input and output types for the wire format (options::serialize, probes
/// that serialize). Throws invalid_argument when one of them has no inspect() overload.
template <class Job>
void register_wire_types() {
  using in = typename job_traits<Job>::input_type;
  using out = typename job_traits<Job>::output_type;
  if constexpr (wire_serializable<in> && wire_serializable<out>) {
    ensure_batch_type<in>();
    ensure_batch_type<out>();
  } else {
    throw invalid_argument(
        "options::serialize: the job's input or output type cannot be serialized (give it an "
        "inspect() overload); it could not cross a network either");
  }
}

/// Where a job's consumer leaves consumer::end()'s value for job_handle::get().
template <class R>
using result_slot = std::shared_ptr<std::optional<R>>;

template <class Job>
class typed_consumer final : public consumer_ops {
 public:
  using traits = job_traits<Job>;
  using out = typename traits::output_type;

  typed_consumer(const config& cfg, result_slot<typename traits::result_type> slot)
      : c_(make_with<typename traits::consumer_type>(cfg)), slot_(std::move(slot)) {}

  bool work(batch& outputs, job_gate& gate) override {
    auto& c = *c_;
    if constexpr (traits::folds) {
      if (outputs.get() != nullptr &&
          outputs.get()->item_type() == typeid(folded_chunk<consumer_type>)) {
        // A chunk folded on its producer: its consumer merged in, as one step.
        auto& folded = *static_cast<const folded_chunk<consumer_type>*>(outputs.get());
        if (gate.stopped()) return true;
        member_ = "merge";
        c.merge(std::move(folded.part()));
        member_ = "work";
        gate.add_delivered(folded.size());
        folded.dispose();  // here, before the job can end: not wherever the message goes
        return true;
      }
    }
    auto* items = outputs.as<out>();
    if (items == nullptr) return false;
    std::uint64_t n = 0;
    struct count {  // also when work() throws: what it took before counts as delivered
      job_gate& g;
      std::uint64_t& n;
      ~count() { g.add_delivered(n); }
    } counted{gate, n};
    auto& xs = items->items;
    if constexpr (std::is_same<out, bool>::value) {  // std::vector<bool>: no data()
      for (; n < xs.size() && !gate.stopped(); ++n) c.work(bool(xs[n]));
    } else {
      consume_checked(c, xs.data(), xs.size(), gate, fast_, n);
    }
    return true;
  }
  void end() override { slot_->emplace(c_->end()); }
  void destroy() override { c_.reset(); }
  [[nodiscard]] const char* member() const noexcept override { return member_; }

 private:
  using consumer_type = typename traits::consumer_type;

  throwing_owner<typename traits::consumer_type> c_;
  result_slot<typename traits::result_type> slot_;
  bool fast_ = false;            ///< the last chunk of 64 items or more took under 100 ns per item
  const char* member_ = "work";  ///< the member work() calls: "merge" for a folded chunk
};

template <class Job>
consumer_maker make_consumer_maker(result_slot<typename job_traits<Job>::result_type> slot) {
  return [slot = std::move(slot)](const config& cfg) -> std::unique_ptr<consumer_ops> {
    return std::make_unique<typed_consumer<Job>>(cfg, slot);
  };
}

}  // namespace troupe::detail
