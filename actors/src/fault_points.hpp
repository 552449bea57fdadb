// Places where a test may stretch the scheduler's timing, to widen a race the scheduler must
// survive (a preemption at the worst moment, made certain). Null in production: one relaxed
// atomic load each.
#pragma once

#include <atomic>

namespace troupe::detail::fault_points {

/// Called as the scheduler arms a wakeup (a retry's backoff, a chunk becoming late), after it
/// computed the time from a clock read earlier in the event.
extern std::atomic<void (*)()> before_wake;

}  // namespace troupe::detail::fault_points
