// The nodes this process serves, for observers (troupe/detail/node_view.hpp).
#include "troupe/detail/node_view.hpp"

namespace troupe::detail {

published_list<node_view>& served_nodes() {
  static auto* list = new published_list<node_view>;  // never destroyed: nodes may outlive it
  return *list;
}

std::vector<node_view> node_views() {
  return served_nodes().views();
}

}  // namespace troupe::detail
