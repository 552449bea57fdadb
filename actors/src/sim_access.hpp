// What tests reach inside a troupe::testing::simulation that its users do not: the mistakes
// planted in its schedulers (planted_bug), to show that the property tests catch them.
#pragma once

#include "planted_bug.hpp"
#include "runtime_impl.hpp"
#include "troupe/simulation.hpp"

namespace troupe::detail {

struct sim_access {
  /// The schedulers of the runners `sim` makes from now on carry mistake `b`.
  static void plant(testing::simulation& sim, planted_bug b);
};

}  // namespace troupe::detail
