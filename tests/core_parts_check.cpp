// The scheduler's parts (fair share, the producer model, the reorder window and in-flight table,
// the statistics), the training coordinator's (train_core.hpp, train_coordinator.hpp: the tree,
// the planner, the step's control flow) and the membership of a live cluster (membership.hpp)
// compile on their own, with a payload of the test's choosing, and include no CAF header:
// tests/core_parts_no_caf.sh compiles this file and fails if one is reached.
#include "fair_share.hpp"
#include "producer_model.hpp"
#include "scheduler_parts.hpp"
#include "split_policy.hpp"
#include "stats_box.hpp"
#include "trace.hpp"
// The training coordinator's pure parts, and a live cluster's membership, too.
#include "../torch/src/train_coordinator.hpp"
#include "troupe/internal/membership.hpp"

namespace {
struct payload {
  [[nodiscard]] bool empty() const noexcept { return true; }
};
}  // namespace

template class troupe::detail::basic_reorder_window<payload>;
template class troupe::detail::basic_inflight_table<payload>;

int main() {
  troupe::detail::basic_reorder_window<payload> w;
  w.add(0, 1, payload{});
  return static_cast<int>(w.release([](payload) {})) - 1;
}
