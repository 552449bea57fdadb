// Starting producers and replicas on nodes (troupe/internal/ask_node.hpp).
#include "troupe/internal/ask_node.hpp"

#include "troupe/detail/network.hpp"

namespace troupe::detail {

caf::actor spawn_on_node(caf::actor_system& sys, caf::actor& node, const std::string& address,
                         const tls& t, const spawn_producer& req, const caf::actor& owner,
                         const node_deadlines& d, const char* kind) {
  if (!node) {
    try {
      node = connect_node(sys, address, t, d.connect, nullptr);
    } catch (const node_error& e) {
      throw node_start_failed(e.what(), address);
    }
  }
  auto answer = ask_watched<caf::actor>(sys, node, d.spawn, req, owner);
  // ask_watched ends by itself (answer, error, timeout or down); the extra second only guards
  // against a CAF that would lose the answer.
  if (answer.wait_for(d.spawn + std::chrono::seconds{1}) != std::future_status::ready) {
    node = nullptr;
    throw node_start_failed("node " + address + " cannot start a " + std::string{kind} + " on " +
                                req.device + ": no answer within " +
                                std::to_string(d.spawn.count()) + " ms",
                            address);
  }
  auto got = answer.get();
  if (got) return std::move(*got);
  node = nullptr;  // connected anew next time (a node restarted, say)
  auto code = error_code(got.error());
  auto why = "node " + address + " cannot start a " + std::string{kind} + " on " + req.device +
             ": " +
             (got.error() == caf::sec::request_timeout
                  ? "no answer within " + std::to_string(d.spawn.count()) + " ms"
                  : error_text(got.error()));
  if (code == errc::device_unavailable) throw device_unavailable(why);
  throw node_start_failed(why, address);
}

bool leaving_or_gone(const std::string& address, const tls& t, std::chrono::milliseconds wait) {
  bool leaving = false;
  try {
    connect_node(network_system(t), address, t, wait, nullptr, nullptr, &leaving);
  } catch (const node_error&) {
    return true;
  }
  return leaving;
}

}  // namespace troupe::detail
