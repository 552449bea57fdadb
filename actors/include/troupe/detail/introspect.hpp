// What an observer (troupe::metrics_text, the status page) reads of the runners alive in this
// process: snapshots, taken under each runner's own locks. No CAF header here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "troupe/device.hpp"
#include "troupe/options.hpp"

namespace troupe::detail {

struct runner_snapshot {
  std::uint64_t id = 0;  ///< the runner's number in this process (1, 2, ...), never reused
  bool open = false;
  bool simulated = false;
  std::vector<device> devices;  ///< present now
  troupe::stats stats;
  std::uint64_t jobs_submitted = 0;
  /// Items of running jobs (of known size) not yet handed to a producer.
  std::uint64_t queued_items = 0;
};

/// Every runner alive in this process, oldest first.
std::vector<runner_snapshot> runner_snapshots();

}  // namespace troupe::detail
