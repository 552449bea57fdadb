// A node's actor's state (node.cpp): the producers it spawned, by coordinator, its watchers and
// its drain. troupe's sources only.
#pragma once

#include <caf/actor.hpp>
#include <caf/actor_addr.hpp>
#include <caf/node_id.hpp>
#include <caf/response_promise.hpp>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "troupe/detail/node_view.hpp"
#include "troupe/device.hpp"

namespace troupe {

struct node_state {
  std::vector<device> devices;
  std::uint64_t incarnation = 0;  ///< random, new at every serve(): a restart is a new member
  std::size_t max_producers_per_coordinator = 0;
  std::map<caf::actor_addr, std::vector<caf::actor>> producers_of;  ///< by owner
  std::map<caf::node_id, std::size_t> producers_on;                 ///< by the owner's node
  /// node::drain: no new producers; the callers of drain wait for the last one to end.
  bool draining = false;
  std::vector<caf::response_promise> drained;
  /// Clusters' watchers (watch_atom): told when the node drains, so that its leave is a
  /// drain for them too, not a loss. At most max_watchers.
  std::vector<caf::actor> watchers;
  static constexpr std::size_t max_watchers = 1024;

  [[nodiscard]] std::int64_t left() const {
    std::int64_t n = 0;
    for (auto& [owner, ps] : producers_of) n += static_cast<std::int64_t>(ps.size());
    return n;
  }
  [[nodiscard]] bool empty() const { return left() == 0; }
  /// What observers read (node_views()): updated after every change of the fields above.
  std::shared_ptr<detail::node_numbers> numbers;
  void publish(int spawned = 0, int refused = 0) {
    std::lock_guard<std::mutex> guard{numbers->mtx};
    auto& v = numbers->view;
    v.incarnation = incarnation;
    v.draining = draining;
    v.producers = static_cast<std::size_t>(left());
    v.coordinators = 0;
    for (auto& [owner, ps] : producers_of) v.coordinators += ps.empty() ? 0 : 1;
    v.watchers = watchers.size();
    v.producers_spawned += static_cast<std::uint64_t>(spawned);
    v.spawns_refused += static_cast<std::uint64_t>(refused);
  }
  /// Whether `producer` (an actor id) is one of the producers of a coordinator on `requester`.
  [[nodiscard]] bool owns(const caf::node_id& requester, std::uint64_t producer) const {
    for (auto& [owner, ps] : producers_of)
      if (owner.node() == requester)
        for (auto& p : ps)
          if (p.id() == producer) return true;
    return false;
  }
  /// Answers the drain's callers with the producers still there (0: all ended).
  void answer_drained() {
    for (auto& rp : drained) rp.deliver(left());
    drained.clear();
  }
};

}  // namespace troupe
