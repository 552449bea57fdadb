// Per-job options and reports: deadlines, weights, error policies (docs/api.md, "One pool,
// many jobs").
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "troupe/options.hpp"

namespace troupe {

/// What happens when producer::work throws on an item of a job.
struct error_policy {
  /// The first failure ends the job: get() throws work_error (the default).
  static error_policy fail() { return error_policy{}; }
  /// Failed items are left out (never reach the consumer) and listed in job_report::failures;
  /// more than `max_failures` of them end the job with work_error.
  static error_policy skip(std::size_t max_failures = std::numeric_limits<std::size_t>::max()) {
    error_policy p;
    p.skips = true;
    p.max_failures = max_failures;
    return p;
  }
  /// A failing item runs again, up to `attempts` more times (on another producer when there is
  /// one), after `backoff`; when every attempt failed, the job fails (or the item is skipped
  /// with then_skip()).
  static error_policy retry(unsigned attempts, std::chrono::milliseconds backoff = {}) {
    error_policy p;
    p.retries = attempts;
    p.backoff = backoff;
    return p;
  }
  /// retry(n).then_skip(): an item that failed every attempt is skipped instead.
  [[nodiscard]] error_policy then_skip(
      std::size_t max_failures = std::numeric_limits<std::size_t>::max()) const {
    auto p = *this;
    p.skips = true;
    p.max_failures = max_failures;
    return p;
  }
  /// True for fail(): a job stops at its first failure.
  [[nodiscard]] bool fails_fast() const noexcept { return !skips && retries == 0; }

  unsigned retries = 0;  ///< attempts after the first
  std::chrono::milliseconds backoff{0};
  bool skips = false;
  std::size_t max_failures = 0;
};

struct job_options {
  /// 0: none. Past it the job ends, its remaining items withdrawn, and get() throws
  /// deadline_exceeded (counted from submit()), without waiting for a busy consumer.
  /// milliseconds::max() means none.
  std::chrono::milliseconds deadline{0};
  /// The job's share of producer time among the jobs running at the same time (a job with
  /// weight 3 gets about three times the producer time of one with weight 1).
  unsigned weight = 1;
  error_policy on_error = error_policy::fail();
  /// Called on the scheduler's thread, as options::on_progress (which is called too).
  std::function<void(const progress&)> on_progress;
};

/// An item left out of a job by error_policy::skip.
struct item_failure {
  std::uint64_t index = 0;  ///< its 0-based position in the job's input
  std::string what;         ///< what work() threw (the last attempt)
  std::string where;        ///< the device of the last attempt, as work_error::where()
  unsigned attempts = 0;    ///< how many times it ran
};

struct job_report {
  std::uint64_t items = 0;             ///< inputs read
  std::uint64_t delivered = 0;         ///< outputs handed to the consumer or the stream
  std::vector<item_failure> failures;  ///< skipped items, in index order
  std::uint64_t retries = 0;           ///< work attempts repeated after a throw
  std::uint64_t redispatched = 0;      ///< items resent after a producer was lost or timed out
};

}  // namespace troupe
