// What a test may plant in the real scheduler (scheduler_io::planted, sim_host::planted).
#pragma once

namespace troupe::detail {

/// Mistakes a test plants in the real scheduler, each on a cold path, to show that the property
/// tests catch them: a retry is dropped; a late answer's outputs (a chunk already delivered,
/// e.g. by a speculative copy) are delivered again; a wakeup whose time has passed is sent at
/// once (a livelock in virtual time, found by the property tests at seed 11096); a chunk split
/// for an idle producer loses the first item it moves. The scheduler asks its io
/// (scheduler_io::planted): none in a runner; tests/simulation_seeds_test.cpp plants them in a
/// simulation, tests/scheduler_split_test.cpp in its fake io.
enum class planted_bug : int {
  none = 0,
  drop_retry,
  deliver_late_answer,
  wake_at_once,
  split_drops_item
};

}  // namespace troupe::detail
