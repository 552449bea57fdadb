// Asking actors on nodes without waiting for a dead node (troupe's sources only; not installed).
// CAF 0.17 never fails a request whose receiver's node died: it waits for the request's whole
// timeout. These watch the receiver (a proxy: it goes down when its node's connection drops), so
// its death ends the wait at once. One timeout policy for starting producers and replicas on
// nodes (runners and data_parallel alike): spawn_on_node.
#pragma once

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/system_messages.hpp>
#include <chrono>
#include <future>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "troupe/detail/network.hpp"
#include "troupe/device.hpp"
#include "troupe/error.hpp"
#include "troupe/log.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

/// Sends `xs...` to `dest` as a request, from an actor of its own that monitors `dest`; the
/// future holds the answer (a T), the receiver's error, CAF's request_timeout after `deadline`
/// (0: no deadline),
/// or errc::node_error "... went down" as soon as `dest` goes down (its node died, or its
/// connection to this process dropped). Never blocks.
template <class T, class... Ts>
std::future<caf::expected<T>> ask_watched(caf::actor_system& sys, const caf::actor& dest,
                                          std::chrono::milliseconds deadline, Ts... xs) {
  auto result = std::make_shared<std::promise<caf::expected<T>>>();
  auto out = result->get_future();
  if (!dest) {
    result->set_value(make_error(errc::node_error, "no actor to ask"));
    return out;
  }
  // The unused bool: a spawn without an argument makes CAF 0.17.6 dereference a null
  // std::shared_ptr<std::tuple<>> (UBSan reports it).
  sys.spawn(
      [result, dest, deadline, args = std::make_tuple(std::move(xs)...)](
          caf::event_based_actor* self, bool) mutable -> caf::behavior {
        auto done = std::make_shared<bool>(false);
        auto finish = [self, result, done](caf::expected<T> r) {
          if (*done) return;
          *done = true;
          result->set_value(std::move(r));
          self->quit();
        };
        self->set_down_handler([finish, dest](caf::down_msg& dm) {
          if (dm.source == dest.address())
            finish(make_error(errc::node_error,
                              "it went down (its node died, or the connection to it dropped)"));
        });
        self->monitor(dest);
        auto on_answer = [finish](T& x) { finish(std::move(x)); };
        auto on_error = [finish](caf::error& e) { finish(std::move(e)); };
        std::apply(
            [&](auto&... a) {
              if (deadline.count() > 0)
                self->request(dest, deadline, std::move(a)...).then(on_answer, on_error);
              else
                self->request(dest, caf::infinite, std::move(a)...).then(on_answer, on_error);
            },
            args);
        return {[](std::uint8_t) {}};  // lives until finish(): only the answer or a down ends it
      },
      true);
  return out;
}

/// Starting a producer or replica on a node (its spawn or its init) failed because of that
/// node: it died, or refused (it drains, say). A runner or data_parallel that follows a cluster
/// starts without a node that left meanwhile (leaving_or_gone); others see a node_error.
class node_start_failed : public node_error {
 public:
  node_start_failed(const std::string& what, std::string node)
      : node_error(what), node_(std::move(node)) {}
  [[nodiscard]] const std::string& node() const noexcept { return node_; }

 private:
  std::string node_;
};

/// Whether the node at `address` is leaving (it drains) or gone (no answer within `wait`).
bool leaving_or_gone(const std::string& address, const tls& t, std::chrono::milliseconds wait);

/// Starts `what` (a runner, data_parallel) that follows a cluster on `devices`, the cluster's
/// snapshot, with `start(devices)`. When that throws node_start_failed for a node that is
/// leaving or gone (leaving_or_gone, within `wait`), starts again without that node, with a
/// warning: the node's next process joins as a rejoin. Any other failure is rethrown;
/// node_error when no device is left.
template <class Start>
void start_without_leavers(const std::vector<device>& devices, const tls& t,
                           std::chrono::milliseconds wait, const std::string& what, Start start) {
  std::set<std::string> without;
  for (;;) {
    std::vector<device> ds;
    for (auto& d : devices)
      if (d.is_local() || without.count(d.node()) == 0) ds.push_back(d);
    if (ds.empty()) throw node_error("every member of the cluster left while " + what + " started");
    try {
      start(std::move(ds));
      return;
    } catch (const node_start_failed& e) {
      if (!leaving_or_gone(e.node(), t, wait)) throw;
      log(log_level::warn, what + " following its cluster starts without " + e.node() +
                               ", which left while it started there (" + e.what() +
                               "); its next process joins as a rejoin");
      without.insert(e.node());
    }
  }
}

/// Starts `req` for `owner` on the node at `address` (connecting first when `node` is null:
/// `node` keeps the connection for the next call, and is reset when the node failed, so that
/// the next call connects anew). Returns the producer's or replica's actor. Throws
/// device_unavailable, or node_start_failed naming the node and the device: at once when the
/// node dies meanwhile, at the latest after `d.connect` + `d.spawn`.
caf::actor spawn_on_node(caf::actor_system& sys, caf::actor& node, const std::string& address,
                         const tls& t, const spawn_producer& req, const caf::actor& owner,
                         const node_deadlines& d, const char* kind = "producer");

}  // namespace troupe::detail
