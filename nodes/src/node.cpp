// A node (docs/api.md, "node"): serving this process's devices to coordinators, and leaving
// gracefully (drain, serve_until_signal). The network system and connections are in
// network.cpp.
#include "troupe/node.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/io/middleman.hpp>
#include <caf/openssl/publish.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <cerrno>
#include <cstring>
#include <map>
#include <thread>

#include "node_state.hpp"
#include "troupe/detail/network.hpp"
#include "troupe/detail/node_view.hpp"
#include "troupe/error.hpp"
#include "troupe/internal/registry.hpp"
#include "troupe/internal/remote_cuts.hpp"
#include "troupe/log.hpp"
#include "troupe/protocol.hpp"

namespace troupe {

// -- node ----------------------------------------------------------------------------------------

namespace {

/// Why nothing can listen on host:port ("Address already in use"; CAF says only "tcp socket
/// creation failed"), or "" when a bind works.
std::string bind_error(const std::string& host, std::uint16_t port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res)
    return {};
  std::string why;
  if (int fd = ::socket(res->ai_family, res->ai_socktype, 0); fd >= 0) {
    int one = 1;  // as CAF binds (reuse_addr)
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, res->ai_addr, res->ai_addrlen) != 0) why = std::strerror(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return why;
}

std::string join(const std::vector<std::string>& xs) {
  std::string out;
  for (auto& x : xs) out += (out.empty() ? "" : ", ") + x;
  return out.empty() ? "none" : out;
}

caf::behavior node_actor(caf::event_based_actor* self, std::vector<device> devices,
                         std::uint64_t incarnation, std::shared_ptr<detail::node_numbers> numbers) {
  auto st = std::make_shared<node_state>();
  st->devices = std::move(devices);
  st->incarnation = incarnation;
  st->numbers = std::move(numbers);
  st->publish();
  // A coordinator that is gone (process killed, network cut) leaves no producer behind.
  st->max_producers_per_coordinator = network_limits().max_producers_per_coordinator;
  self->set_down_handler([self, st](caf::down_msg& dm) {
    auto w = std::find_if(st->watchers.begin(), st->watchers.end(),
                          [&](const caf::actor& a) { return a.address() == dm.source; });
    if (w != st->watchers.end()) {
      st->watchers.erase(w);
      st->publish();
      return;
    }
    auto i = st->producers_of.find(dm.source);
    if (i == st->producers_of.end()) {
      // One of the producers (its coordinator ended it, e.g. after draining it).
      for (auto& [owner, ps] : st->producers_of) {
        auto before = ps.size();
        ps.erase(std::remove_if(ps.begin(), ps.end(),
                                [&](const caf::actor& p) { return p.address() == dm.source; }),
                 ps.end());
        if (ps.size() != before) {
          auto j = st->producers_on.find(owner.node());
          if (j != st->producers_on.end() && j->second > 0) j->second -= 1;
        }
      }
      st->publish();
      if (st->draining && st->empty()) st->answer_drained();
      return;
    }
    for (auto& p : i->second) self->send_exit(p, caf::exit_reason::user_shutdown);
    auto j = st->producers_on.find(dm.source.node());
    if (j != st->producers_on.end()) {
      j->second -= std::min(j->second, i->second.size());
      if (j->second == 0) st->producers_on.erase(j);
    }
    st->producers_of.erase(i);
    st->publish();
    if (st->draining && st->empty()) st->answer_drained();
  });
  self->attach_functor([st](const caf::error&) {
    for (auto& [owner, producers] : st->producers_of)
      for (auto& p : producers) caf::anon_send_exit(p, caf::exit_reason::user_shutdown);
    st->producers_of.clear();
  });
  return {
      [self, st](given_up_atom, std::uint64_t incarnation) {
        // A cluster gave this process up (it was frozen or cut off past lost_after) and uses
        // nothing of it again. Start over as a restart would, without one: every producer ends
        // (their coordinators fenced them, or will see a new incarnation and fence them), and
        // a new incarnation is a new member for every cluster.
        if (incarnation != st->incarnation || st->draining) return;
        for (auto& [owner, ps] : st->producers_of)
          for (auto& p : ps) self->send_exit(p, caf::exit_reason::user_shutdown);
        st->incarnation = detail::new_incarnation();
        log(log_level::warn, "node: a cluster gave up on this process (incarnation " +
                                 std::to_string(incarnation) +
                                 "): its producers end, and it answers as incarnation " +
                                 std::to_string(st->incarnation));
        st->publish();
      },
      [self, st](trim_atom, std::uint64_t producer, std::uint64_t cut_id, std::uint64_t items,
                 bool all, bool ask) -> std::int64_t {
        auto from = self->current_sender();  // only for the requester's own producers
        return from && st->owns(from->node(), producer)
                   ? detail::remote_cuts::trim(producer, cut_id, items, all, ask)
                   : -1;
      },
      [st](hello_atom) {
        node_hello hello{node_protocol_version, {}, st->incarnation, st->draining};
        for (auto& d : st->devices) hello.devices.push_back(d.str());
        return hello;
      },
      [self, st](drain_atom, std::int64_t deadline_ms) -> caf::result<std::int64_t> {
        // Each coordinator hears which of its producers are leaving: it sends them no new work,
        // lets their chunks finish and ends them (a graceful leave, not a loss).
        st->draining = true;
        st->publish();
        for (auto& w : st->watchers) self->send(w, leaving_atom::value, st->incarnation);
        if (st->empty()) return std::int64_t{0};
        for (auto& [owner, ps] : st->producers_of) {
          if (ps.empty()) continue;
          auto to = caf::actor_cast<caf::actor>(owner);
          if (to) self->send(to, leaving_atom::value, ps);
        }
        st->drained.push_back(self->make_response_promise());
        constexpr std::int64_t century_ms = std::int64_t{100} * 365 * 24 * 3600 * 1000;
        self->delayed_send(
            self, std::chrono::milliseconds{std::clamp<std::int64_t>(deadline_ms, 0, century_ms)},
            drain_atom::value);
        return st->drained.back();
      },
      [st](drain_atom) { st->answer_drained(); },  // the deadline: the rest are left to stop()
      [self, st](watch_atom) {
        auto w = caf::actor_cast<caf::actor>(self->current_sender());
        if (!w) return;
        if (st->draining) {
          self->send(w, leaving_atom::value, st->incarnation);
          return;
        }
        if (st->watchers.size() >= node_state::max_watchers ||
            std::find(st->watchers.begin(), st->watchers.end(), w) != st->watchers.end())
          return;
        st->watchers.push_back(w);
        self->monitor(w);
        st->publish();
      },
      [self, st](spawn_producer& req, const caf::actor& owner) -> caf::result<caf::actor> {
        auto refuse = [&st](auto code, const std::string& why) {
          st->publish(0, 1);
          return make_error(code, why);
        };
        if (st->draining)
          return refuse(errc::node_error, "refused: this node is draining (shutting down)");
        // The owner's end ends its producers (monitor below). Only an owner on the requester's
        // own node is known to end: a proxy for a node this one never connected to is never
        // reported down, and its producers would live (a thread each) forever.
        auto sender = self->current_sender();
        if (!owner || sender == nullptr || owner.node() != sender->node())
          return refuse(errc::node_error,
                        "refused: a producer's owner must be an actor of the requesting "
                        "coordinator");
        auto& count = st->producers_on[owner.node()];
        if (count >= st->max_producers_per_coordinator)
          return refuse(errc::node_error,
                        "refused: this coordinator already has " + std::to_string(count) +
                            " producers here (limits::max_producers_per_coordinator)");
        auto job = find_job(req.job);
        if (!job.spawn)
          return refuse(errc::node_error, "this node does not run job '" + req.job +
                                              "' (it registers: " + join(registered_jobs()) + ")");
        if (job.signature != req.signature)
          return refuse(errc::node_error, "job '" + req.job + "' here takes " + job.signature +
                                              ", the coordinator's takes " + req.signature +
                                              ": build both programs from the same job definition");
        std::unique_ptr<device> d;
        try {
          d = std::make_unique<device>(req.device);
        } catch (const std::exception& e) {
          return refuse(errc::invalid_argument, e.what());
        }
        if (!d->is_local() ||
            std::find(st->devices.begin(), st->devices.end(), *d) == st->devices.end()) {
          std::vector<std::string> offered;
          for (auto& x : st->devices) offered.push_back(x.str());
          return refuse(errc::device_unavailable,
                        "this node offers " + join(offered) + ", not " + req.device);
        }
        auto p = job.spawn(self->system(), *d, req.cfg, static_cast<std::size_t>(req.index));
        auto& mine = st->producers_of[owner.address()];
        if (mine.empty()) self->monitor(owner);
        mine.push_back(p);
        self->monitor(p);  // a producer ended by its coordinator (drain) leaves the list
        count += 1;
        st->publish(1, 0);
        return p;
      },
  };
}

}  // namespace

struct node::impl {
  caf::actor_system* sys = nullptr;
  caf::actor actor;
  std::string host;
  std::uint16_t port = 0;
  std::uint64_t incarnation = 0;
  std::chrono::milliseconds drain_timeout{30'000};  ///< drain()'s (node_options::drain_timeout)
  std::shared_ptr<detail::node_numbers> numbers = std::make_shared<detail::node_numbers>();
  ~impl() { detail::served_nodes().remove(numbers.get()); }
};

node::node(std::unique_ptr<impl> p) : impl_(std::move(p)) {}
node::node(node&&) noexcept = default;
node& node::operator=(node&& other) noexcept {
  if (this != &other) {
    stop();
    impl_ = std::move(other.impl_);
  }
  return *this;
}
node::~node() {
  stop();
}

node node::serve(const std::string& host_port, std::vector<device> devices, tls t) {
  auto hp = detail::parse_host_port(host_port);
  if (devices.empty()) throw invalid_argument("a node needs at least one device to offer");
  for (auto& d : devices) {
    if (!d.is_local()) throw invalid_argument("a node offers its own devices, not " + d.str());
    if (auto why = why_unavailable(d); !why.empty()) throw device_unavailable(why);
  }
  auto p = std::make_unique<impl>();
  p->sys = &detail::network_system(t);
  p->incarnation = detail::new_incarnation();
  p->actor = p->sys->spawn(node_actor, std::move(devices), p->incarnation, p->numbers);
  p->host = hp.host;
  auto port = t.enabled() ? caf::openssl::publish(p->actor, hp.port, hp.host.c_str(), true)
                          : p->sys->middleman().publish(p->actor, hp.port, hp.host.c_str(), true);
  if (!port) {
    auto why = p->sys->render(port.error());
    if (port.error() == caf::sec::cannot_open_port)
      if (auto e = bind_error(hp.host, hp.port); !e.empty()) why = e + " (" + why + ")";
    caf::anon_send_exit(p->actor, caf::exit_reason::user_shutdown);
    p->actor = nullptr;
    throw node_error("cannot serve on " + host_port + ": " + why);
  }
  p->port = *port;
  if (!t.enabled()) detail::note_plain_serve_host(hp.host);
  {
    std::lock_guard<std::mutex> guard{p->numbers->mtx};
    p->numbers->view.address = p->host + ":" + std::to_string(p->port);
  }
  detail::served_nodes().add(p->numbers);
  return node{std::move(p)};
}

node node::serve(const std::string& host_port, std::vector<device> devices, tls t,
                 const limits& l) {
  set_network_limits(l);
  return serve(host_port, std::move(devices), std::move(t));
}

node node::serve(const std::string& host_port, std::vector<device> devices, tls t,
                 const node_options& o) {
  if (o.drain_timeout.count() < 0)
    throw invalid_argument("node_options: drain_timeout must not be negative (0: stop at once)");
  set_network_limits(o);
  auto n = serve(host_port, std::move(devices), std::move(t));
  n.impl_->drain_timeout = o.drain_timeout;
  return n;
}

std::size_t node::drain() {
  return drain(impl_ ? impl_->drain_timeout : std::chrono::milliseconds{30'000});
}

std::size_t node::drain(std::chrono::milliseconds deadline) {
  if (!impl_ || !impl_->actor) return 0;
  // No new coordinator: the port closes (connections made already stay, for the chunks'
  // answers).
  impl_->sys->middleman().unpublish(impl_->actor, impl_->port);
  // A deadline of a century or more (milliseconds::max(): none) is a century: the timer below
  // counts in nanoseconds, and the wait adds 5 s to it.
  deadline = std::clamp(deadline, std::chrono::milliseconds{0},
                        std::chrono::milliseconds{std::chrono::hours{24 * 365 * 100}});
  std::int64_t left = -1;
  {
    caf::scoped_actor self{*impl_->sys};
    auto wait = deadline + std::chrono::seconds{5};  // the node answers at the deadline
    self->request(impl_->actor, wait, drain_atom::value,
                  static_cast<std::int64_t>(deadline.count()))
        .receive([&](std::int64_t n) { left = n; },
                 [&](const caf::error&) {});  // stopped meanwhile (a second signal)
  }
  // The clusters that watch this node were told it leaves (drain_atom): give that notice a
  // moment on the wire before the connections close, so that a node without producers is not
  // taken for lost.
  std::this_thread::sleep_for(std::chrono::milliseconds{100});
  stop();
  return left < 0 ? 0 : static_cast<std::size_t>(left);
}

namespace {

int signal_pipe[2] = {-1, -1};

extern "C" void on_stop_signal(int sig) {
  auto saved = errno;
  unsigned char b = static_cast<unsigned char>(sig);
  (void)!::write(signal_pipe[1], &b, 1);
  errno = saved;
}

/// Waits for a byte from the signal pipe; the signal's number.
int next_signal() {
  unsigned char b = 0;
  while (::read(signal_pipe[0], &b, 1) < 0 && errno == EINTR) {
  }
  return b;
}

}  // namespace

int node::serve_until_signal(const std::string& host_port, std::vector<device> devices, tls t,
                             const node_options& o) {
  // A handler that writes to a pipe (async-signal-safe) works whichever thread the signal
  // reaches, CAF's included.
  if (signal_pipe[0] < 0 && ::pipe2(signal_pipe, O_CLOEXEC) != 0)
    throw node_error("serve_until_signal: cannot make a pipe");
  {  // a byte left from an earlier call must not count as a signal now
    int flags = ::fcntl(signal_pipe[0], F_GETFL);
    ::fcntl(signal_pipe[0], F_SETFL, flags | O_NONBLOCK);
    unsigned char junk[64];
    while (::read(signal_pipe[0], junk, sizeof junk) > 0) {
    }
    ::fcntl(signal_pipe[0], F_SETFL, flags);
  }
  struct sigaction sa {
  }, old_term{}, old_int{};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &sa, &old_term);
  sigaction(SIGINT, &sa, &old_int);
  auto restore = [&] {
    sigaction(SIGTERM, &old_term, nullptr);
    sigaction(SIGINT, &old_int, nullptr);
  };
  int rc = 0;
  try {
    auto n = serve(host_port, std::move(devices), std::move(t), o);
    if (o.on_serving) o.on_serving(n);
    int sig = next_signal();
    log(log_level::info, "node " + n.address() + ": signal " + std::to_string(sig) +
                             ", draining (a second signal stops it at once)");
    // A second signal stops the node at once: the node answers drain() now (the producers
    // still busy are stopped by the stop() that follows).
    auto actor = n.impl_->actor;
    std::atomic<bool> drained{false};
    std::atomic<bool> stopped_at_once{false};
    std::thread second([&] {
      next_signal();
      if (drained) return;
      stopped_at_once = true;
      caf::anon_send(actor, drain_atom::value);
    });
    struct joiner {  // also when drain() throws: a joinable thread must not be destroyed
      std::thread& t;
      std::atomic<bool>& done;
      ~joiner() {
        done = true;
        on_stop_signal(0);  // wakes the watcher if no second signal came
        t.join();
      }
    };
    std::size_t left = 0;
    {
      joiner j{second, drained};
      left = n.drain(o.drain_timeout);
    }
    rc = left > 0 || stopped_at_once ? 1 : 0;
    log(log_level::info, stopped_at_once ? std::string{"node stopped at once"}
                         : left > 0      ? std::to_string(left) +
                                          " producer(s) still busy at the "
                                          "drain deadline were stopped"
                                    : std::string{"node drained"});
  } catch (...) {
    restore();
    throw;
  }
  restore();
  return rc;
}

std::uint16_t node::port() const {
  return impl_ ? impl_->port : 0;
}

std::uint64_t node::incarnation() const {
  if (!impl_) return 0;
  std::lock_guard<std::mutex> guard{impl_->numbers->mtx};  // new after a given_up_atom
  return impl_->numbers->view.incarnation != 0 ? impl_->numbers->view.incarnation
                                               : impl_->incarnation;
}

std::string node::address() const {
  return impl_ ? impl_->host + ":" + std::to_string(impl_->port) : std::string{};
}

void node::stop() {
  if (!impl_) return;
  if (impl_->actor) {
    // Unpublish first: a published port outlives its actor and would hand out a dead one.
    impl_->sys->middleman().unpublish(impl_->actor, impl_->port);
    caf::anon_send_exit(impl_->actor, caf::exit_reason::user_shutdown);
    impl_->actor = nullptr;
  }
  impl_.reset();
}

}  // namespace troupe
