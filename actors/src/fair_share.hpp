// Weighted fair share among a runner's jobs (stride scheduling): every job has a pass, the
// producer time given to it divided by its weight; a free producer takes work from the ready
// job with the least pass. A part of the scheduler's core with no actor in it (no CAF header,
// no clock), unit-tested on its own in tests/scheduler_parts_test.cpp. Its cost per operation is
// logarithmic in the number of jobs, so that an event costs about the same with 10 or 10,000
// jobs running.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <stdexcept>
#include <unordered_map>
#include <utility>

namespace troupe::detail {

class fair_share {
 public:
  /// A new job starts level with the least served running job: it neither waits for the
  /// others' past nor takes their turn for long. Not ready yet. Returns its pass.
  double join(std::uint64_t id) {
    double pass = by_pass_.empty() ? 0 : by_pass_.begin()->first;
    if (!jobs_.emplace(id, state{pass, false}).second)
      throw std::logic_error("fair_share: a job joined twice");
    by_pass_.emplace(pass, id);
    return pass;
  }

  /// The job has ended (unknown ids are ignored).
  void leave(std::uint64_t id) {
    auto i = jobs_.find(id);
    if (i == jobs_.end()) return;
    by_pass_.erase({i->second.pass, id});
    if (i->second.ready) ready_.erase({i->second.pass, id});
    jobs_.erase(i);
  }

  /// `cost` (producer nanoseconds, say) given to the job, whose weight is `weight` (> 0).
  void charge(std::uint64_t id, double cost, double weight) {
    auto& s = at(id);
    by_pass_.erase({s.pass, id});
    if (s.ready) ready_.erase({s.pass, id});
    s.pass += cost / weight;
    by_pass_.emplace(s.pass, id);
    if (s.ready) ready_.emplace(s.pass, id);
  }

  /// Whether the job may have work for a producer.
  void set_ready(std::uint64_t id, bool ready) {
    auto& s = at(id);
    if (ready == s.ready) return;
    if (ready)
      ready_.emplace(s.pass, id);
    else
      ready_.erase({s.pass, id});
    s.ready = ready;
  }

  [[nodiscard]] bool ready(std::uint64_t id) const { return at(id).ready; }
  /// Whether some job may have work (marked ready; pick() may still find it has none).
  [[nodiscard]] bool any_ready() const noexcept { return !ready_.empty(); }
  [[nodiscard]] double pass(std::uint64_t id) const { return at(id).pass; }
  [[nodiscard]] std::size_t size() const noexcept { return jobs_.size(); }

  /// The ready job with the least pass for which `takes(id)` holds, if any. Jobs for which
  /// `still_ready(id)` no longer holds (their state changed since they were marked) are
  /// marked not ready on the way.
  template <class StillReady, class Takes>
  std::optional<std::uint64_t> pick(StillReady&& still_ready, Takes&& takes) {
    for (auto i = ready_.begin(); i != ready_.end();) {
      auto id = i->second;
      if (!still_ready(id)) {
        jobs_.at(id).ready = false;
        i = ready_.erase(i);
        continue;
      }
      if (takes(id)) return id;
      ++i;
    }
    return std::nullopt;
  }

 private:
  struct state {
    double pass = 0;
    bool ready = false;
  };
  state& at(std::uint64_t id) {
    auto i = jobs_.find(id);
    if (i == jobs_.end()) throw std::logic_error("fair_share: an unknown job");
    return i->second;
  }
  [[nodiscard]] const state& at(std::uint64_t id) const {
    auto i = jobs_.find(id);
    if (i == jobs_.end()) throw std::logic_error("fair_share: an unknown job");
    return i->second;
  }
  std::unordered_map<std::uint64_t, state> jobs_;
  std::set<std::pair<double, std::uint64_t>> by_pass_;  ///< every job
  std::set<std::pair<double, std::uint64_t>> ready_;    ///< the jobs that may have work
};

}  // namespace troupe::detail
