// Several machines (docs/api.md, "Several machines"): any program linking troupe can serve as a
// node; coordinators connect to nodes and run the ordinary runners over their devices
// ("HOST:PORT/cpu").
// The transport is CAF's own network layer (middleman, BASP), optionally over mutual TLS.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "troupe/device.hpp"
#include "troupe/error.hpp"

namespace troupe {

/// Mutual TLS through CAF's OpenSSL module. A node with these settings refuses peers without a
/// certificate signed by `ca`. Empty `cert` means plain TCP.
struct tls {
  std::string cert;        ///< PEM certificate file
  std::string key;         ///< PEM private key file
  std::string ca;          ///< PEM file of the CA that signs peers' certificates
  std::string passphrase;  ///< of the key, if it has one
  [[nodiscard]] bool enabled() const noexcept { return !cert.empty(); }
};

/// What a process on the network (node or coordinator) accepts from its peers. A peer that
/// breaks a limit is disconnected (the connection, not the process); see docs/deploy.md.
/// max_message_bytes, handshake_timeout and max_connections are enforced inside CAF by troupe's
/// patches (third_party/caf): a CAF without them ignores those settings silently.
/// idle_timeout is stock CAF (heartbeats); max_producers_per_coordinator is troupe's own.
struct limits {
  /// Largest message a peer may announce (BASP payload). troupe sends anything of 1 MiB or
  /// more as 1 MiB bulk fragments, so legitimate messages stay far below this.
  std::size_t max_message_bytes = std::size_t{64} << 20;
  /// A connection that has not completed CAF's handshake in this time is closed; this also
  /// closes connections that never send anything.
  std::chrono::milliseconds handshake_timeout{10'000};
  /// A connected peer that has sent nothing (not even a heartbeat, sent every `heartbeat`) for
  /// this long is given up on (its producers end, its chunks go elsewhere).
  std::chrono::milliseconds idle_timeout{1'500};
  /// How often this process sends CAF's heartbeat on every connection (both sides do). Each one
  /// costs the receiving process a wake-up: a coordinator of a thousand nodes sets it to a
  /// second or more (and idle_timeout to several times it, on both sides). At most
  /// idle_timeout / 2.
  std::chrono::milliseconds heartbeat{200};
  /// Most connections a process keeps open; beyond it, the oldest connection still in its
  /// handshake is closed first (so a flood of idle connections cannot lock peers out).
  std::size_t max_connections = 256;
  /// Most producers one coordinator may have on a node at once (node side only).
  std::size_t max_producers_per_coordinator = 256;
};

/// Sets the limits of this process's network use. Call before the first network use (node,
/// cluster, runner over remote devices); throws invalid_argument afterwards (when they differ),
/// when a value is 0, max_message_bytes is under 2 MiB or 4 GiB or more, max_connections over a
/// million, a duration over a day, idle_timeout under 500 ms or under twice the heartbeat.
void set_network_limits(const limits& l);
/// The limits in effect (or to take effect).
limits network_limits();

/// How many threads troupe's own actor system runs for consumers (default: one per core, at
/// least 2; producers and schedulers have threads of their own). Call before troupe's first
/// runner, node or data_parallel of the process; throws invalid_argument afterwards (with
/// another value) and for 0 or more than 4096. A CAF application can build runners on its own actor
/// system instead (<troupe/caf.hpp>).
void set_threads(std::size_t n);

/// Reads the certificate, key (with its passphrase) and CA files with OpenSSL; throws
/// invalid_argument saying which file is wrong (also when the key is not the certificate's). Done
/// before any TLS connection: CAF's module fails inside its own thread on a bad key or passphrase,
/// and the handshake then hangs. A process has one TLS identity: every networked part of it uses
/// the same settings.
void check_tls(const tls& t);

class node;

/// A node's settings: the network limits (connections, message size, handshake and idle
/// deadlines, producers per coordinator) and how it drains.
struct node_options : limits {
  /// node::drain's default deadline, and serve_until_signal's on SIGTERM / SIGINT; not
  /// negative (serve throws invalid_argument).
  std::chrono::milliseconds drain_timeout{30'000};
  /// serve_until_signal: called once the node listens (e.g. to print its address).
  std::function<void(const node&)> on_serving;
};

/// A node serving this process's devices to remote coordinators.
class node {
 public:
  /// Publishes a node on HOST:PORT (port 0: any free port) offering `devices`, and returns once
  /// it listens. Throws invalid_argument (bad address, bad TLS files) or node_error.
  static node serve(const std::string& host_port, std::vector<device> devices, tls t = {});
  /// The same, with set_network_limits(l) first.
  static node serve(const std::string& host_port, std::vector<device> devices, tls t,
                    const limits& l);
  /// The same, with set_network_limits(o) first.
  static node serve(const std::string& host_port, std::vector<device> devices, tls t,
                    const node_options& o);
  /// Serves until SIGTERM or SIGINT, then drains (o.drain_timeout) and returns 0, or 1 when
  /// producers were still busy at the deadline (they are stopped). A second signal while it
  /// drains stops the node at once (returns 1). The signals' previous handlers are restored.
  static int serve_until_signal(const std::string& host_port, std::vector<device> devices,
                                tls t = {}, const node_options& o = {});

  node(node&&) noexcept;
  node& operator=(node&&) noexcept;
  ~node();

  [[nodiscard]] std::uint16_t port() const;
  /// This node's incarnation: random, new at every serve() (so at every start of its process),
  /// and new when a cluster that gave this process up (a freeze or partition past its
  /// lost_after) finds it again: the node then starts over as a restart would (its producers end).
  /// Coordinators tell a restarted node from the one they gave up on by it.
  [[nodiscard]] std::uint64_t incarnation() const;
  /// "HOST:PORT" as coordinators should name it.
  [[nodiscard]] std::string address() const;
  /// Stops serving: unpublishes, ends every producer it spawned. Idempotent.
  void stop();
  /// Leaves gracefully: takes no new coordinator or producer, tells each coordinator that its
  /// producers here are leaving (they get no new work, their chunks in flight finish and are
  /// delivered, producer::end() runs: the coordinator reports them removed, not lost), waits
  /// until they have ended or `deadline` has passed (the rest are stopped: their coordinators
  /// re-send those chunks elsewhere), then stop(). Returns the producers still busy at the
  /// deadline (0: all left cleanly). milliseconds::max(): no deadline. Idempotent.
  std::size_t drain(std::chrono::milliseconds deadline);
  /// The same with node_options::drain_timeout when it was served with node_options, else 30 s.
  std::size_t drain();

 private:
  struct impl;
  explicit node(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

/// A change of a cluster's membership (cluster_options::on_change).
struct membership_event {
  enum kind {
    joined,    ///< a node is a member (cluster::connect, cluster::add): runners use its devices
    draining,  ///< cluster::remove began: runners give it no new work, its chunks finish
    drained,   ///< cluster::remove ended: its producers have ended (a graceful leave)
    lost,      ///< it stopped answering (or restarted): its incarnation is given up on (fenced)
    rejoined   ///< a node lost earlier answers again as a new incarnation (restarted): runners
               ///< that follow the cluster start producers there, in the jobs that run
  } what = joined;
  std::string node;               ///< "HOST:PORT"
  std::uint64_t incarnation = 0;  ///< of the node process the event is about
  std::vector<device> devices;    ///< its devices, as "HOST:PORT/device"
};

/// A cluster's view of one node.
struct member {
  enum class state { up, draining, drained, lost };
  std::string address;            ///< "HOST:PORT"
  std::uint64_t incarnation = 0;  ///< the node process's (node::incarnation())
  state what = state::up;
  std::vector<device> devices;  ///< as "HOST:PORT/device"
};

/// What "what" says, in words ("joined", "draining", ...).
const char* to_string(membership_event::kind k) noexcept;
const char* to_string(member::state s) noexcept;

/// How a live cluster watches its nodes.
struct cluster_options {
  /// A lost node is tried again in the background; when a new incarnation answers (the node
  /// was restarted), runners that follow the cluster start producers on it in the running jobs.
  bool reconnect = true;
  std::chrono::milliseconds reconnect_every{1000};
  /// No connect or handshake (connect, add, reconnect) waits longer for a node.
  std::chrono::milliseconds connect_timeout{5000};
  /// Every member is asked for a sign of life this often; one silent for lost_after is lost:
  /// its incarnation is given up on (fenced: its producers' late answers are dropped, and it
  /// never becomes a member again; its restart does). A member whose process ends, or whose
  /// connection CAF closes (silent for limits::idle_timeout: frozen), is lost at once (within
  /// a tenth of a second), whatever the probes' period; one that said it drains is drained.
  std::chrono::milliseconds heartbeat{200}, lost_after{1500};
  /// At most this many probes a second in all (0: no bound). With more members than heartbeat
  /// allows within it, each member is asked every members / probes_per_second instead, and
  /// lost_after grows in the same proportion (1,000 members: every 10 s, lost after 75 s, when
  /// its connection stays open; an ended or frozen one is lost as above). Each probe and its
  /// answer cost the coordinator tens of microseconds of CPU (BENCHMARKS.md, "Liveness at a
  /// thousand members").
  std::size_t probes_per_second = 100;
  /// Called on a thread of the cluster's, in order, after runners following the cluster have
  /// acted on the change (producers started, drained or given up on). Must not throw.
  std::function<void(const membership_event&)> on_change;
  /// Live connect: how many nodes must answer. connect() tries every node at once, within
  /// connect_timeout in all, and returns with those that answered; the others are members not
  /// yet up (members(): lost, incarnation 0), retried like lost ones (reconnect_every), and
  /// `joined` (on_change, and the running jobs of runners that follow) when they answer. Throws
  /// node_error only when fewer than min_nodes answered. 0: every node must answer (else
  /// node_error, as before).
  std::size_t min_nodes = 0;
  /// Where nodes are found (e.g. troupe::dns_discovery): called at connect and every
  /// discover_every, on a thread of the cluster's. An address that appears joins (or, not
  /// answering yet, is retried); one that was listed and vanishes is drained (as by remove():
  /// `draining`, `drained`, never `lost`; a member not up is no longer retried). A call that
  /// throws changes nothing (logged once, until it succeeds again). connect()'s own list may
  /// then be empty; its addresses are never drained by discovery.
  std::function<std::vector<std::string>()> discover;
  std::chrono::milliseconds discover_every{5000};
};

/// Discovery by DNS (cluster_options::discover): every IPv4 address that NAME resolves to
/// (getaddrinfo: DNS, /etc/hosts), as "ADDRESS:PORT", sorted. A Kubernetes headless service's
/// name resolves to one address per ready pod. A name that does not resolve (or resolves to no
/// IPv4 address) throws node_error: the cluster changes nothing then. invalid_argument for a
/// spec that is not NAME:PORT.
std::function<std::vector<std::string>()> dns_discovery(const std::string& name_port);

namespace detail {
class cluster_state;
}

/// A live set of nodes: TLS settings, membership and the runners that follow it. Copies share
/// it; the last copy's end stops watching (runners built from it keep the producers they have).
class cluster {
 public:
  /// Connects to every node (within `deadline` each) and lists its devices. Throws node_error
  /// naming the node and the reason. The TLS settings are also remembered for these nodes, so
  /// that runners built over `devices()` use them.
  static cluster connect(const std::vector<std::string>& nodes, tls t = {},
                         std::chrono::milliseconds deadline = std::chrono::seconds{5});
  /// The same, watched: nodes are probed (heartbeat, lost_after), lost ones retried (reconnect).
  static cluster connect(const std::vector<std::string>& nodes, tls t, cluster_options o);

  /// Joins a node: connects (within connect_timeout: node_error otherwise), then every runner
  /// that follows the cluster starts producers on its devices, in the jobs that run; returns
  /// once they have. invalid_argument for a node that is a member already (up or draining).
  void add(const std::string& node);
  /// Drains a node: runners that follow the cluster give its producers no new work, their
  /// chunks finish, producer::end() runs; returns when they are gone (the member is then
  /// `drained`; add() it again to use it). The node process keeps running (node::drain stops
  /// one). invalid_argument for a node that is not up, or when a runner following the cluster
  /// would be left without producers (nothing is drained then).
  void remove(const std::string& node);

  /// Every device of every member that is up, as "HOST:PORT/device" (now).
  [[nodiscard]] std::vector<device> devices() const;
  /// The addresses of the members that are up (now).
  [[nodiscard]] std::vector<std::string> nodes() const;
  /// Every node the cluster has known, with its incarnation and state (now).
  [[nodiscard]] std::vector<member> members() const;
  /// Answers from incarnations given up on that were dropped (probes and connects; the
  /// producers' late answers are counted in a runner's stats().late_answers).
  [[nodiscard]] std::size_t fenced_answers() const;
  [[nodiscard]] const tls& tls_settings() const;

  /// For runners that follow the cluster (internal).
  [[nodiscard]] const std::shared_ptr<detail::cluster_state>& state() const noexcept {
    return state_;
  }

 private:
  // No default constructor: a cluster comes from connect() (and `{}` never means a cluster, so
  // runner(devices...) and data_parallel({...}, ...) calls stay unambiguous).
  explicit cluster(std::shared_ptr<detail::cluster_state> s) : state_(std::move(s)) {}
  std::shared_ptr<detail::cluster_state> state_;
};

namespace detail {

struct host_port {
  std::string host;
  std::uint16_t port = 0;
};

/// Parses "HOST:PORT"; throws invalid_argument quoting it.
host_port parse_host_port(const std::string& spec);

}  // namespace detail
}  // namespace troupe
