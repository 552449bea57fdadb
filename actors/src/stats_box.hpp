// The statistics a runner's scheduler keeps and its callers read (runner::stats()).
#pragma once

#include <mutex>

#include "troupe/options.hpp"

namespace troupe::detail {

/// Statistics shared between the scheduler and the caller.
struct stats_box {
  std::mutex mtx;
  troupe::stats value;
};

}  // namespace troupe::detail
