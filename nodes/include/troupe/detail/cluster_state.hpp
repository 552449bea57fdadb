// A live cluster's shared state (nodes/src/cluster.cpp) and what runners that follow it
// implement (actors/src/runtime_follow.cpp). Not included by <troupe/troupe.hpp>.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "troupe/node.hpp"

namespace troupe::detail {

/// A runner that follows a cluster. The cluster calls it on its notifier thread, one event at
/// a time, in order: joined / rejoined (start producers on the event's devices), draining
/// (drain the node's producers; returns when they are gone), lost (its producers are lost now,
/// their late answers dropped). It may throw (logged; cluster::add rethrows the first).
class cluster_follower {
 public:
  virtual ~cluster_follower() = default;
  virtual void on_event(const membership_event& e) = 0;
  /// Whether draining `node` would leave this runner without producers.
  [[nodiscard]] virtual bool needs(const std::string& node) const = 0;
};

class cluster_state;

/// What a runner built from a cluster starts with: the devices of the members up now, and its
/// place among the followers (registered under the same lock, so that it hears every change
/// after the snapshot and none before).
struct cluster_snapshot {
  std::vector<device> devices;
  tls settings;
};

/// What an observer (troupe::metrics_text, the status page) reads of a live cluster.
struct cluster_view {
  std::uint64_t id = 0;  ///< its number in this process (1, 2, ...), never reused
  std::vector<member> members;
  std::size_t fenced_answers = 0;
};
/// Every cluster alive in this process, oldest first.
std::vector<cluster_view> cluster_views();

/// The cluster's connect_timeout: the longest a runner or trainer that follows it waits to
/// connect to a node and for the node's answer to a spawn.
std::chrono::milliseconds connect_timeout(const std::shared_ptr<cluster_state>& c);

/// Registers `f` and returns the devices it starts with (see cluster_snapshot).
cluster_snapshot follow(const std::shared_ptr<cluster_state>& c,
                        const std::shared_ptr<cluster_follower>& f);

}  // namespace troupe::detail
