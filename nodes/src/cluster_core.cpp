// A live cluster's core (cluster_core.hpp): made and ended, members joined and removed (the
// notifier does the work), and what the cluster reads of it.
#include "cluster_core.hpp"

#include <algorithm>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>
#include <future>
#include <unordered_set>

#include "troupe/detail/network.hpp"
#include "troupe/error.hpp"
#include "troupe/log.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

namespace {

caf::behavior leaving_listener(caf::event_based_actor* self, std::shared_ptr<leaving_sink> sink) {
  // A member's node actor that goes down: its process ended (a connection reset at once) or
  // CAF closed its silent connection (limits::idle_timeout). The downs loop acts on it without
  // waiting for the probes (probes_per_second: at many members they are seconds apart). Each
  // node actor is monitored once (a member is watched again at each reconnect).
  auto monitored = std::make_shared<std::unordered_set<caf::actor_addr>>();
  self->set_down_handler([sink, monitored](caf::down_msg& dm) {
    monitored->erase(dm.source);
    std::lock_guard<std::mutex> guard{sink->mtx};
    if (sink->gone.size() < 65536) sink->gone.push_back(dm.source);
  });
  return {
      [self, monitored](watch_atom, const caf::actor& node) {
        if (!node) return;
        if (monitored->insert(node.address()).second) self->monitor(node);
        self->send(node, watch_atom::value);  // its drain notice comes here
      },
      [self, sink](leaving_atom, std::uint64_t incarnation) {
        auto sender = caf::actor_cast<caf::actor_addr>(self->current_sender());
        if (!sender) return;
        std::lock_guard<std::mutex> guard{sink->mtx};
        if (sink->notices.size() < 4096) sink->notices.emplace_back(sender, incarnation);
      },
  };
}

}  // namespace

std::vector<device> devices_at(const std::string& address, const std::vector<std::string>& ds) {
  std::vector<device> out;
  for (auto& d : ds) out.emplace_back(address + "/" + d);
  return out;
}

cluster_core::cluster_core(tls t, cluster_options o, bool watch)
    : t_(std::move(t)),
      o_(std::move(o)),
      watch_(watch),
      core_(o_.lost_after),
      probe_every_(o_.heartbeat) {
  sys_ = &network_system(t_);
  if (watch_) listener_ = sys_->spawn(leaving_listener, sink_);
}

cluster_core::~cluster_core() {
  if (listener_) caf::anon_send_exit(listener_, caf::exit_reason::user_shutdown);
}

void cluster_core::stop() {
  {
    std::lock_guard<std::mutex> guard{mtx_};
    stopping_ = true;
  }
  cv_.notify_all();
}

void cluster_core::join(const std::string& address, bool rethrow) {
  refuse_on_notifier("cluster::add");
  parse_host_port(address);
  {
    std::lock_guard<std::mutex> guard{mtx_};
    auto st = core_.state_of(address);
    if (st && (*st == member::state::up || *st == member::state::draining))
      throw invalid_argument("cluster::add: " + address + " is a member already (" +
                             to_string(*st) + ")");
  }
  auto r = reach(address);
  if (r.error) std::rethrow_exception(r.error);
  admit(r, rethrow);
}

cluster_core::reached cluster_core::reach(const std::string& address) {
  reached r;
  r.address = address;
  try {
    r.handle = connect_node(*sys_, address, t_, o_.connect_timeout, &r.offered, &r.incarnation,
                            &r.leaving, [this] { return stopping(); });
  } catch (...) {
    r.error = std::current_exception();
  }
  return r;
}

void cluster_core::admit(reached& r, bool rethrow) {
  auto& address = r.address;
  if (r.leaving)
    throw node_error("cannot use node " + address + ": it is draining (shutting down)");
  remember_tls(address, t_);
  std::shared_ptr<batch> b;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (core_.fenced(address, r.incarnation)) {
      core_.answered(address, r.incarnation, {}, clock::now(), true);  // counted
      caf::anon_send(r.handle, given_up_atom::value, r.incarnation);   // starts over
      throw node_error("cannot use node " + address +
                       ": it answered as the process this cluster gave up on (incarnation " +
                       std::to_string(r.incarnation) +
                       "); it was asked to start over as a new incarnation, which joins by "
                       "itself (reconnect) or at the next add()");
    }
    if (auto other = core_.spelled_otherwise(address, r.incarnation))
      throw invalid_argument("cannot use node " + address + ": it is the node " + *other +
                             ", a member already (the same process, another spelling of its "
                             "address)");
    auto events =
        core_.answered(address, r.incarnation, devices_at(address, r.offered), clock::now(), true);
    handles_[address] = r.handle;
    watch(r.handle);
    if (events.empty()) return;  // a member already (a concurrent add)
    b = enqueue(std::move(events));
  }
  cv_.notify_all();
  b->done.get_future().wait();
  if (rethrow && b->first_error) std::rethrow_exception(b->first_error);
}

void cluster_core::connect_all(std::vector<std::string> addresses) {
  {
    std::lock_guard<std::mutex> guard{mtx_};
    given_.insert(addresses.begin(), addresses.end());  // never drained by discovery
  }
  if (discovering()) {
    std::vector<std::string> found;
    try {
      found = o_.discover();
    } catch (const std::exception& e) {
      if (addresses.empty())
        throw node_error(std::string{"cluster::connect: discovery failed: "} + e.what());
      log(log_level::warn, std::string{"cluster discovery failed at connect: "} + e.what());
    }
    {
      std::lock_guard<std::mutex> guard{mtx_};
      discovered_.insert(found.begin(), found.end());
    }
    for (auto& a : found)
      if (std::find(addresses.begin(), addresses.end(), a) == addresses.end())
        addresses.push_back(a);
  }
  if (addresses.empty())
    throw node_error("cluster::connect: no node to connect to (discovery found none)");
  for (auto& a : addresses) parse_host_port(a);  // all checked before any is tried
  // Every node at once: connect_node bounds each by connect_timeout, so all of them together.
  std::vector<std::future<reached>> tries;
  for (auto& a : addresses)
    tries.push_back(std::async(std::launch::async, [this, a] { return reach(a); }));
  std::vector<reached> got;
  for (auto& t : tries) got.push_back(t.get());
  // Two spellings of one node (an IP and a name, or a name that discovery lists by address):
  // one member, the first; the others are not members (nor retried).
  std::map<std::uint64_t, std::string> node_at;
  for (auto it = got.begin(); it != got.end();) {
    if (it->error || it->leaving) {
      ++it;
      continue;
    }
    auto [first, fresh] = node_at.emplace(it->incarnation, it->address);
    if (fresh) {
      ++it;
      continue;
    }
    log(log_level::warn, "cluster: " + it->address + " is the node " + first->second +
                             " (the same process): one member");
    it = got.erase(it);
  }
  std::size_t answered = 0;
  std::exception_ptr first;
  for (auto& r : got) {
    if (!r.error && !r.leaving)
      ++answered;
    else if (!first)
      first = r.error ? r.error
                      : std::make_exception_ptr(node_error("cannot use node " + r.address +
                                                           ": it is draining (shutting down)"));
  }
  auto needed = o_.min_nodes == 0 ? got.size() : o_.min_nodes;
  if (answered < needed) {
    auto short_of = "cluster::connect: " + std::to_string(answered) + " of " +
                    std::to_string(got.size()) + " nodes answered, min_nodes is " +
                    std::to_string(o_.min_nodes);
    // Every node answered, and there are fewer than min_nodes (a name that resolves to fewer
    // addresses than the cluster needs): no node's error to pass on.
    if (!first) throw node_error(short_of);
    if (o_.min_nodes == 0) std::rethrow_exception(first);
    try {
      std::rethrow_exception(first);
    } catch (const std::exception& e) {
      throw node_error(short_of + "; the first that did not: " + e.what());
    }
  }
  for (auto& r : got) {
    if (!r.error && !r.leaving) {
      admit(r, false);
      continue;
    }
    std::string why = "draining";
    try {
      if (r.error) std::rethrow_exception(r.error);
    } catch (const std::exception& e) {
      why = e.what();
    }
    log(log_level::warn, "cluster: " + r.address + " is not up yet (" + why + "); retried");
    std::lock_guard<std::mutex> guard{mtx_};
    core_.expect(r.address, clock::now());
  }
}

void cluster_core::remove(const std::string& address) {
  refuse_on_notifier("cluster::remove");
  std::shared_ptr<batch> b;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    auto st = core_.state_of(address);
    if (!st) throw invalid_argument("cluster::remove: " + address + " is not a member");
    if (*st != member::state::up)
      throw invalid_argument("cluster::remove: " + address + " is " + to_string(*st) + ", not up");
    b = enqueue({});
    b->removing = address;
  }
  cv_.notify_all();
  b->done.get_future().wait();
  if (b->first_error) std::rethrow_exception(b->first_error);
}

cluster_snapshot cluster_core::follow(const std::shared_ptr<cluster_follower>& f) {
  std::lock_guard<std::mutex> guard{mtx_};
  prune();
  followers_.push_back(f);
  return {devices_locked(), t_};
}

std::vector<device> cluster_core::devices() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return devices_locked();
}

std::vector<std::string> cluster_core::nodes() const {
  std::lock_guard<std::mutex> guard{mtx_};
  std::vector<std::string> out;
  for (auto& m : core_.members())
    if (m.what == member::state::up) out.push_back(m.address);
  return out;
}

std::vector<member> cluster_core::members() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return core_.members();
}

std::size_t cluster_core::fenced_answers() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return core_.fenced_answers();
}

std::vector<device> cluster_core::devices_locked() const {
  std::vector<device> out;
  for (auto& m : core_.members())
    if (m.what == member::state::up) out.insert(out.end(), m.devices.begin(), m.devices.end());
  return out;
}

void cluster_core::prune() {
  followers_.erase(
      std::remove_if(followers_.begin(), followers_.end(),
                     [](const std::weak_ptr<cluster_follower>& w) { return w.expired(); }),
      followers_.end());
}

void cluster_core::refuse_on_notifier(const char* what) {
  if (on_notifier)
    throw invalid_argument(std::string{what} +
                           " inside on_change (or a runner's reaction to a change) would wait "
                           "for itself: call it from another thread");
}

std::shared_ptr<cluster_core::batch> cluster_core::enqueue(std::vector<membership_event> events) {
  auto b = std::make_shared<batch>();
  b->events = std::move(events);
  prune();
  b->to = followers_;
  queue_.push_back(b);
  return b;
}

}  // namespace troupe::detail
