// What an observer (troupe::metrics_text, the status page) reads of the nodes this process
// serves (node::serve): kept up to date by each node's actor, read under its own lock. No CAF
// header here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "troupe/detail/published.hpp"

namespace troupe::detail {

struct node_view {
  std::string address;  ///< "host:port" it listens on
  std::uint64_t incarnation = 0;
  bool draining = false;
  std::size_t producers = 0;     ///< producers it runs now, for all its coordinators
  std::size_t coordinators = 0;  ///< coordinators with producers here now
  std::size_t watchers = 0;      ///< clusters watching it (told when it drains)
  std::uint64_t producers_spawned = 0;
  std::uint64_t spawns_refused = 0;  ///< spawn requests refused (draining, limits, job, device)
};

/// One served node's numbers: its actor writes them, observers copy them.
using node_numbers = published<node_view>;
/// Every node this process serves (from serve(), once it listens, to stop()), oldest first.
published_list<node_view>& served_nodes();
/// served_nodes().views().
std::vector<node_view> node_views();

}  // namespace troupe::detail
