// Two switches a test binary sets for every scheduler in it, runners included: a stretch of the
// scheduler's timing, to widen a race it must survive (a preemption at the worst moment, made
// certain), and a check of its index at every pass. Off in production: one relaxed atomic load
// each. Mistakes planted to test the tests are not here: they go through the scheduler's io.
#pragma once

#include <atomic>

namespace troupe::detail::fault_points {

/// Called as the scheduler arms a wakeup (a retry's backoff, a chunk becoming late), after it
/// computed the time from a clock read earlier in the event.
extern std::atomic<void (*)()> before_wake;

/// Tests set it: the scheduler checks its index of the producers with room against a scan of
/// every producer at every pass (a change that missed room_changed() throws std::logic_error).
/// A switch for a whole test binary (its runners and simulations included), not a mistake: the
/// mistakes tests plant go through the scheduler's io (planted_bug, scheduler_io.hpp).
extern std::atomic<bool> check_indexes;

}  // namespace troupe::detail::fault_points
