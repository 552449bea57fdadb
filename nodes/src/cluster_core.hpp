// A live cluster's core (cluster.cpp): everything its watcher, reconnector and notifier threads
// share. Defined in cluster_core.cpp (joining, removing, reading), cluster_notify.cpp (the
// notifier) and cluster_watch.cpp (the watcher and the reconnector).
#pragma once

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "troupe/detail/cluster_state.hpp"
#include "troupe/internal/membership.hpp"

namespace troupe::detail {

std::vector<device> devices_at(const std::string& address, const std::vector<std::string>& ds);

/// Members that said they drain themselves (node::drain, SIGTERM): their leave is a drain, not
/// a loss. Filled by the listener actor, read by the watcher.
struct leaving_sink {
  std::mutex mtx;
  /// The node actor that said it drains, and its incarnation. By actor, not by CAF node id:
  /// several nodes may serve in one process, and a node id is a process id and host hashes.
  std::vector<std::pair<caf::actor_addr, std::uint64_t>> notices;
  /// Members' node actors that went down (the listener monitors them): the process ended, or
  /// CAF closed its connection (limits::idle_timeout: a frozen process). Read by the downs loop.
  std::vector<caf::actor_addr> gone;
};

/// The notifier thread (on_change and the followers run there): cluster::add and remove,
/// which wait for it, are refused on it.
extern thread_local bool on_notifier;

/// Everything the cluster's threads share: they hold it, so that the last `cluster` copy may
/// go anywhere, even inside on_change (cluster_state only stops them).
class cluster_core {
  friend class cluster_state;  // runs the loops

 public:
  cluster_core(tls t, cluster_options o, bool watch);
  ~cluster_core();

  [[nodiscard]] bool watching() const { return watch_; }
  [[nodiscard]] bool reconnecting() const { return watch_ && o_.reconnect; }
  [[nodiscard]] bool discovering() const { return watch_ && static_cast<bool>(o_.discover); }

  void stop();

  /// cluster::connect and cluster::add: `joining` a member (add: the first error of the
  /// runners that follow is rethrown).
  void join(const std::string& address, bool rethrow);

  /// A live cluster::connect: every address at once (connect_timeout in all), plus what
  /// discovery finds; those that answered join, the others are expected (retried) when at
  /// least min_nodes answered, else node_error.
  void connect_all(std::vector<std::string> addresses);

  /// Drains `address` from every follower: decided on the notifier, between the other changes
  /// (so that no loss or other drain slips between the check and the drain). Rethrows a
  /// follower's refusal; the member is then up again.
  void remove(const std::string& address);

  cluster_snapshot follow(const std::shared_ptr<cluster_follower>& f);

  std::vector<device> devices() const;
  std::vector<std::string> nodes() const;
  std::vector<member> members() const;
  std::size_t fenced_answers() const;
  const tls& settings() const { return t_; }
  const cluster_options& options() const { return o_; }

 private:
  using clock = std::chrono::steady_clock;

  struct batch {
    std::vector<membership_event> events;
    std::vector<std::weak_ptr<cluster_follower>> to;  ///< the followers when it happened
    std::promise<void> done;
    std::exception_ptr first_error;
    std::string removing;  ///< cluster::remove of this address (no events yet)
  };

  std::vector<device> devices_locked() const;
  void prune();
  static void refuse_on_notifier(const char* what);
  /// Under mtx_: the events go to the runners that follow now.
  std::shared_ptr<batch> enqueue(std::vector<membership_event> events);

  // The notifier (cluster_notify.cpp).
  void tell(batch& b, const membership_event& e);
  void report(const membership_event& e);
  void notify_loop();
  /// cluster::remove, on the notifier: the member must still be up and no follower may need it
  /// (else invalid_argument, nothing drained); draining, the followers drain it, drained. A
  /// follower that fails to drain: the member is up again and the error goes to remove().
  void drain(batch& b);

  /// A node reached (or not): connect_node's answer, or its error.
  struct reached {
    std::string address;
    caf::actor handle;
    std::vector<std::string> offered;
    std::uint64_t incarnation = 0;
    bool leaving = false;
    std::exception_ptr error;
  };
  /// Connects to `address` within connect_timeout; never throws (the error is kept).
  reached reach(const std::string& address);
  /// Makes a reached node a member (joined): the followers start producers on it; returns when
  /// they have (`rethrow`: their first error is thrown).
  void admit(reached& r, bool rethrow);

  // Discovery (discovery.cpp): the addresses that appear join, those that vanish drain.
  void discover_loop();
  void appear(const std::string& address);
  void vanish(const std::string& address);

  // The watcher and the reconnector (cluster_watch.cpp).
  bool pause(std::chrono::milliseconds d);
  /// Runs `loop` (a thread's), never ending the process on an exception: logged as `name`'s,
  /// and the loop starts again after `again`.
  void guarded(const char* name, void (cluster_core::*loop)(), std::chrono::milliseconds again);
  void watch_loop();
  void reconnect_loop();
  /// Under mtx_: the leaving notices received so far, applied (draining events), then the
  /// members whose node actor went down (lost at once, or drained when they said they would
  /// leave), whatever the probe period.
  std::vector<membership_event> take_notices_locked(clock::time_point now);
  /// Acts on the members' downs (and drain notices) every tenth of a second, on a thread of its
  /// own: a probe round waits up to a probe period (seconds at many members) for a silent
  /// member, and a loss must not wait behind it.
  void downs_loop();
  /// The reconnector found `address` answering as an incarnation given up on: asks it to start
  /// over as a new one (given_up_atom; rate-limited by reconnect_every like any retry). True
  /// then (nothing of that answer is used).
  bool ask_to_start_over(const std::string& address, const caf::actor& handle,
                         std::uint64_t incarnation);
  /// The reconnector reached `address` (its node actor, incarnation, devices and whether it is
  /// leaving): a member back, or one asked to start over.
  void rejoin(const std::string& address, caf::actor handle, std::uint64_t incarnation,
              const std::vector<std::string>& offered, bool leaving);
  /// Asks the node to tell the listener when it drains itself, and the listener to monitor it.
  void watch(const caf::actor& node);
  bool stopping();

  tls t_;
  cluster_options o_;
  caf::actor_system* sys_ = nullptr;
  mutable std::mutex mtx_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool watch_ = false;
  membership core_;
  /// How often the watcher probes each member now (probe_period; under mtx_).
  std::chrono::milliseconds probe_every_;
  std::map<std::string, caf::actor> handles_;  ///< the members' node actors
  std::vector<std::weak_ptr<cluster_follower>> followers_;
  std::deque<std::shared_ptr<batch>> queue_;
  std::shared_ptr<leaving_sink> sink_ = std::make_shared<leaving_sink>();
  caf::actor listener_;  ///< hears members that drain themselves (watching clusters only)
  std::set<std::string> discovered_;  ///< what discovery listed last
  std::set<std::string> given_;       ///< connect()'s own addresses: discovery never drains them
};

}  // namespace troupe::detail
