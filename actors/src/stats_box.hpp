// The statistics a runner's scheduler keeps and its callers read (runner::stats()).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>

#include "troupe/options.hpp"

namespace troupe::detail {

/// Statistics shared between the scheduler and the caller.
struct stats_box {
  std::mutex mtx;
  troupe::stats value;
  /// Items of running jobs (of known size) not yet pulled for a producer: what
  /// options::max_queued_items bounds. submit() adds, the scheduler takes away.
  std::atomic<std::uint64_t> queued{0};
};

}  // namespace troupe::detail
