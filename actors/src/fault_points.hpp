// Places where a test may stretch the scheduler's timing, to widen a race the scheduler must
// survive (a preemption at the worst moment, made certain). Null in production: one relaxed
// atomic load each.
#pragma once

#include <atomic>

namespace troupe::detail::fault_points {

/// Called as the scheduler arms a wakeup (a retry's backoff, a chunk becoming late), after it
/// computed the time from a clock read earlier in the event.
extern std::atomic<void (*)()> before_wake;

/// Mistakes the property tests must catch (tests/simulation_seeds_test.cpp), planted in the real
/// scheduler on a cold path: a retry is dropped; a late answer's outputs (a chunk already
/// delivered, e.g. by a speculative copy) are delivered again; a wakeup whose time has passed
/// is sent at once (a livelock in virtual time, found by the property tests at seed 11096); a
/// chunk split for an idle producer loses the first item it moves (tests/scheduler_split_test.cpp).
/// Tests set it: the scheduler checks its index of the producers with room against a scan of
/// every producer at every pass (a change that missed room_changed() throws std::logic_error).
extern std::atomic<bool> check_indexes;

enum class planted_bug : int {
  none = 0,
  drop_retry,
  deliver_late_answer,
  wake_at_once,
  split_drops_item
};
extern std::atomic<planted_bug> planted;

}  // namespace troupe::detail::fault_points
