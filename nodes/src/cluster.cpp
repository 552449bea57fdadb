// A live cluster (docs/api.md, "Pools that change"): the shell around the membership part
// (membership.hpp). Three threads of its own: a watcher (probes every member each heartbeat, and
// gives up on the silent ones), a reconnector (tries lost members again) and a notifier (tells
// the runners that follow the cluster, then on_change, one change at a time, in order). Neither
// probing nor reconnecting ever waits on a runner.
#include <algorithm>
#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "troupe/detail/cluster_state.hpp"
#include "troupe/detail/network.hpp"
#include "troupe/error.hpp"
#include "troupe/internal/membership.hpp"
#include "troupe/log.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

namespace {

std::vector<device> devices_at(const std::string& address, const std::vector<std::string>& ds) {
  std::vector<device> out;
  for (auto& d : ds) out.emplace_back(address + "/" + d);
  return out;
}

void check(const cluster_options& o) {
  if (o.reconnect_every.count() <= 0 || o.connect_timeout.count() <= 0 ||
      o.heartbeat.count() <= 0 || o.lost_after.count() <= 0)
    throw invalid_argument("cluster_options: every duration must be positive");
  if (o.lost_after <= o.heartbeat)
    throw invalid_argument("cluster_options: lost_after must be longer than heartbeat");
}

/// Members that said they drain themselves (node::drain, SIGTERM): their leave is a drain, not
/// a loss. Filled by the listener actor, read by the watcher.
struct leaving_sink {
  std::mutex mtx;
  std::vector<std::pair<caf::node_id, std::uint64_t>> notices;  ///< node, incarnation
};

caf::behavior leaving_listener(caf::event_based_actor* self, std::shared_ptr<leaving_sink> sink) {
  return {
      [self, sink](leaving_atom, std::uint64_t incarnation) {
        auto sender = self->current_sender();
        if (!sender) return;
        std::lock_guard<std::mutex> guard{sink->mtx};
        if (sink->notices.size() < 4096) sink->notices.emplace_back(sender->node(), incarnation);
      },
  };
}

}  // namespace

/// The notifier thread (on_change and the followers run there): cluster::add and remove,
/// which wait for it, are refused on it.
thread_local bool on_notifier = false;

/// Everything the cluster's threads share: they hold it, so that the last `cluster` copy may
/// go anywhere, even inside on_change (cluster_state below only stops them).
class cluster_core {
  friend class cluster_state;  // runs the loops

 public:
  cluster_core(tls t, cluster_options o, bool watch)
      : t_(std::move(t)), o_(std::move(o)), watch_(watch), core_(o_.lost_after) {
    sys_ = &network_system(t_);
    if (watch_) listener_ = sys_->spawn(leaving_listener, sink_);
  }

  ~cluster_core() {
    if (listener_) caf::anon_send_exit(listener_, caf::exit_reason::user_shutdown);
  }

  [[nodiscard]] bool watching() const { return watch_; }
  [[nodiscard]] bool reconnecting() const { return watch_ && o_.reconnect; }

  void stop() {
    {
      std::lock_guard<std::mutex> guard{mtx_};
      stopping_ = true;
    }
    cv_.notify_all();
  }

  /// cluster::connect and cluster::add: `joining` a member (add: the first error of the
  /// runners that follow is rethrown).
  void join(const std::string& address, bool rethrow) {
    refuse_on_notifier("cluster::add");
    parse_host_port(address);
    {
      std::lock_guard<std::mutex> guard{mtx_};
      auto st = core_.state_of(address);
      if (st && (*st == member::state::up || *st == member::state::draining))
        throw invalid_argument("cluster::add: " + address + " is a member already (" +
                               to_string(*st) + ")");
    }
    std::vector<std::string> offered;
    std::uint64_t incarnation = 0;
    bool leaving = false;
    auto handle =
        connect_node(*sys_, address, t_, o_.connect_timeout, &offered, &incarnation, &leaving);
    if (leaving)
      throw node_error("cannot use node " + address + ": it is draining (shutting down)");
    remember_tls(address, t_);
    std::shared_ptr<batch> b;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (core_.fenced(address, incarnation)) {
        core_.answered(address, incarnation, {}, clock::now(), true);  // counted
        throw node_error("cannot use node " + address +
                         ": it answered as the process this cluster gave up on (incarnation " +
                         std::to_string(incarnation) + "); restart it to make it a member again");
      }
      auto events =
          core_.answered(address, incarnation, devices_at(address, offered), clock::now(), true);
      handles_[address] = handle;
      watch(handle);
      if (events.empty()) return;  // a member already (a concurrent add)
      b = enqueue(std::move(events));
    }
    cv_.notify_all();
    b->done.get_future().wait();
    if (rethrow && b->first_error) std::rethrow_exception(b->first_error);
  }

  /// Drains `address` from every follower: decided on the notifier, between the other changes
  /// (so that no loss or other drain slips between the check and the drain). Rethrows a
  /// follower's refusal; the member is then up again.
  void remove(const std::string& address) {
    refuse_on_notifier("cluster::remove");
    std::shared_ptr<batch> b;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      auto st = core_.state_of(address);
      if (!st) throw invalid_argument("cluster::remove: " + address + " is not a member");
      if (*st != member::state::up)
        throw invalid_argument("cluster::remove: " + address + " is " + to_string(*st) +
                               ", not up");
      b = enqueue({});
      b->removing = address;
    }
    cv_.notify_all();
    b->done.get_future().wait();
    if (b->first_error) std::rethrow_exception(b->first_error);
  }

  cluster_snapshot follow(const std::shared_ptr<cluster_follower>& f) {
    std::lock_guard<std::mutex> guard{mtx_};
    prune();
    followers_.push_back(f);
    return {devices_locked(), t_};
  }

  std::vector<device> devices() const {
    std::lock_guard<std::mutex> guard{mtx_};
    return devices_locked();
  }
  std::vector<std::string> nodes() const {
    std::lock_guard<std::mutex> guard{mtx_};
    std::vector<std::string> out;
    for (auto& m : core_.members())
      if (m.what == member::state::up) out.push_back(m.address);
    return out;
  }
  std::vector<member> members() const {
    std::lock_guard<std::mutex> guard{mtx_};
    return core_.members();
  }
  std::size_t fenced_answers() const {
    std::lock_guard<std::mutex> guard{mtx_};
    return core_.fenced_answers();
  }
  const tls& settings() const { return t_; }

 private:
  using clock = std::chrono::steady_clock;

  struct batch {
    std::vector<membership_event> events;
    std::vector<std::weak_ptr<cluster_follower>> to;  ///< the followers when it happened
    std::promise<void> done;
    std::exception_ptr first_error;
    std::string removing;  ///< cluster::remove of this address (no events yet)
  };

  std::vector<device> devices_locked() const {
    std::vector<device> out;
    for (auto& m : core_.members())
      if (m.what == member::state::up) out.insert(out.end(), m.devices.begin(), m.devices.end());
    return out;
  }

  void prune() {
    followers_.erase(
        std::remove_if(followers_.begin(), followers_.end(),
                       [](const std::weak_ptr<cluster_follower>& w) { return w.expired(); }),
        followers_.end());
  }

  static void refuse_on_notifier(const char* what) {
    if (on_notifier)
      throw invalid_argument(std::string{what} +
                             " inside on_change (or a runner's reaction to a change) would wait "
                             "for itself: call it from another thread");
  }

  /// Under mtx_: the events go to the runners that follow now.
  std::shared_ptr<batch> enqueue(std::vector<membership_event> events) {
    auto b = std::make_shared<batch>();
    b->events = std::move(events);
    prune();
    b->to = followers_;
    queue_.push_back(b);
    return b;
  }

  void tell(batch& b, const membership_event& e) {
    for (auto& w : b.to) {
      auto f = w.lock();
      if (!f) continue;
      try {
        f->on_event(e);
      } catch (const std::exception& x) {
        log(log_level::warn, std::string{"a runner following the cluster could not act on "} +
                                 to_string(e.what) + " of " + e.node + ": " + x.what());
        if (!b.first_error) b.first_error = std::current_exception();
      } catch (...) {
        log(log_level::warn, std::string{"a runner following the cluster could not act on "} +
                                 to_string(e.what) + " of " + e.node);
        if (!b.first_error) b.first_error = std::current_exception();
      }
    }
  }

  void report(const membership_event& e) {
    log(e.what == membership_event::lost ? log_level::warn : log_level::info,
        "cluster: " + e.node + " " + to_string(e.what) + " (incarnation " +
            std::to_string(e.incarnation) + ")");
    if (!o_.on_change) return;
    try {
      o_.on_change(e);
    } catch (...) {
      log(log_level::error, "cluster_options::on_change threw; ignored");
    }
  }

  void notify_loop() {
    on_notifier = true;
    for (;;) {
      std::shared_ptr<batch> b;
      {
        std::unique_lock<std::mutex> lock{mtx_};
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping
        b = queue_.front();
        queue_.pop_front();
      }
      if (!b->removing.empty()) {
        drain(*b);
      } else {
        for (auto& e : b->events) {
          if (e.what == membership_event::draining) {
            report(e);  // the node drains itself: it told the coordinators of its producers
            continue;
          }
          tell(*b, e);
          report(e);
        }
      }
      b->done.set_value();
    }
  }

  /// cluster::remove, on the notifier: the member must still be up and no follower may need it
  /// (else invalid_argument, nothing drained); draining, the followers drain it, drained. A
  /// follower that fails to drain: the member is up again and the error goes to remove().
  void drain(batch& b) {
    auto& address = b.removing;
    membership_event e;
    try {
      {
        std::lock_guard<std::mutex> guard{mtx_};
        auto st = core_.state_of(address);
        if (!st || *st != member::state::up)
          throw invalid_argument("cluster::remove: " + address + " is " +
                                 (st ? to_string(*st) : "not a member") + ", not up");
      }
      for (auto& w : b.to)
        if (auto f = w.lock(); f && f->needs(address))
          throw invalid_argument("cluster::remove: " + address +
                                 " has the last producers of a runner that follows the cluster: "
                                 "add another node first, or close that runner; nothing was "
                                 "drained");
      std::lock_guard<std::mutex> guard{mtx_};
      e = core_.begin_drain(address);
    } catch (...) {
      b.first_error = std::current_exception();
      return;
    }
    report(e);
    tell(b, e);
    std::optional<membership_event> d;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (b.first_error)
        core_.cancel_drain(address);
      else
        d = core_.end_drain(address);
    }
    if (d) {
      tell(b, *d);
      report(*d);
    }
  }

  bool pause(std::chrono::milliseconds d) {
    std::unique_lock<std::mutex> lock{mtx_};
    return !cv_.wait_for(lock, d, [&] { return stopping_; });
  }

  /// The loops, never ending the process on an exception (logged; the loop goes on).
  void guarded_watch_loop() {
    while (!stopping()) {
      try {
        watch_loop();
        return;
      } catch (const std::exception& e) {
        log(log_level::error, std::string{"cluster watcher: "} + e.what());
      } catch (...) {
        log(log_level::error, "cluster watcher: an unknown exception");
      }
      pause(o_.heartbeat);
    }
  }
  void guarded_reconnect_loop() {
    while (!stopping()) {
      try {
        reconnect_loop();
        return;
      } catch (const std::exception& e) {
        log(log_level::error, std::string{"cluster reconnector: "} + e.what());
      } catch (...) {
        log(log_level::error, "cluster reconnector: an unknown exception");
      }
      pause(o_.reconnect_every);
    }
  }

  void watch_loop() {
    while (!stopping()) {
      auto start = clock::now();
      std::vector<std::pair<std::string, caf::actor>> targets;
      {
        std::lock_guard<std::mutex> guard{mtx_};
        for (auto& a : core_.watched())
          if (auto i = handles_.find(a); i != handles_.end()) targets.emplace_back(a, i->second);
      }
      struct answer {
        std::string address;
        node_hello hello;
      };
      std::vector<answer> answers;
      if (!targets.empty()) {
        caf::scoped_actor self{*sys_};
        using req = decltype(self->request(targets[0].second, o_.heartbeat, hello_atom::value));
        std::vector<req> pending;
        for (auto& [a, h] : targets)
          pending.push_back(self->request(h, o_.heartbeat, hello_atom::value));
        for (std::size_t i = 0; i < pending.size(); ++i)
          pending[i].receive(
              [&](node_hello& h) {
                answers.push_back({targets[i].first, std::move(h)});
              },
              [](const caf::error&) {});  // silent: counted by lost_after
      }
      std::shared_ptr<batch> b;
      {
        std::lock_guard<std::mutex> guard{mtx_};
        auto now = clock::now();
        auto events = take_notices_locked(now);
        auto add = [&](std::vector<membership_event> more) {
          events.insert(events.end(), more.begin(), more.end());
        };
        for (auto& x : answers) {
          std::vector<device> offered;
          try {
            offered = devices_at(x.address, x.hello.devices);
          } catch (const std::exception&) {
            continue;  // a device this program does not know: not a sign of life to use
          }
          add(core_.answered(x.address, x.hello.incarnation, offered, now, false, x.hello.leaving));
        }
        add(core_.tick(now));
        if (!events.empty()) b = enqueue(std::move(events));
      }
      if (b) cv_.notify_all();
      auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - start);
      if (spent < o_.heartbeat && !pause(o_.heartbeat - spent)) return;
    }
  }

  void reconnect_loop() {
    // Each address at most once per reconnect_every; but one that drained itself (a rolling
    // restart: its next process is expected within moments) every heartbeat, so that it is
    // back in the running jobs soon after it listens again.
    std::map<std::string, clock::time_point> next_try;
    while (pause(std::min(o_.heartbeat, o_.reconnect_every))) {
      // Lost members, and members silent for two heartbeats: a node restarted on the same
      // address answers a connect as a new incarnation long before lost_after.
      std::vector<std::string> lost;
      std::set<std::string> eager;
      auto now = clock::now();
      {
        std::lock_guard<std::mutex> guard{mtx_};
        lost = core_.lost();
        auto quiet = core_.silent(now, 2 * o_.heartbeat);
        lost.insert(lost.end(), quiet.begin(), quiet.end());
        for (auto& a : lost)
          if (core_.leaves_by_itself(a)) eager.insert(a);
      }
      for (auto i = next_try.begin(); i != next_try.end();)  // members back: forgotten
        i = std::find(lost.begin(), lost.end(), i->first) == lost.end() ? next_try.erase(i)
                                                                        : std::next(i);
      for (auto& address : lost) {
        if (stopping()) return;
        if (!eager.count(address)) {
          auto& at = next_try[address];
          if (now < at) continue;
          at = now + o_.reconnect_every;
        }
        std::vector<std::string> offered;
        std::uint64_t incarnation = 0;
        bool leaving = false;
        caf::actor handle;
        try {
          handle = connect_node(*sys_, address, t_, o_.connect_timeout, &offered, &incarnation,
                                &leaving);
        } catch (const std::exception&) {
          continue;  // not back yet
        }
        std::vector<device> devices;
        try {
          devices = devices_at(address, offered);
        } catch (const std::exception& e) {
          log(log_level::warn, "cluster: " + address +
                                   " offers a device this program does not "
                                   "know (" +
                                   e.what() + "); not used");
          continue;
        }
        std::shared_ptr<batch> b;
        {
          std::lock_guard<std::mutex> guard{mtx_};
          auto now = clock::now();
          // Notices first: a node that drained itself has left, whatever answers now.
          auto events = take_notices_locked(now);
          auto more = core_.answered(address, incarnation, devices, now, false, leaving);
          events.insert(events.end(), more.begin(), more.end());
          if (core_.accepts(address, incarnation)) {
            handles_[address] = handle;
            watch(handle);
          }
          if (!events.empty()) b = enqueue(std::move(events));
        }
        if (b) cv_.notify_all();
      }
    }
  }

  /// Under mtx_: the leaving notices received so far, applied (draining events).
  std::vector<membership_event> take_notices_locked(clock::time_point now) {
    std::vector<std::pair<caf::node_id, std::uint64_t>> notices;
    {
      std::lock_guard<std::mutex> guard{sink_->mtx};
      notices.swap(sink_->notices);
    }
    std::vector<membership_event> events;
    for (auto& [where, incarnation] : notices)
      for (auto& m : core_.members())
        if (auto i = handles_.find(m.address); i != handles_.end() && i->second.node() == where) {
          auto more = core_.answered(m.address, incarnation, m.devices, now, false, true);
          events.insert(events.end(), more.begin(), more.end());
        }
    return events;
  }

  /// Asks the node to tell the listener when it drains itself.
  void watch(const caf::actor& node) {
    if (listener_) caf::send_as(listener_, node, watch_atom::value);
  }

  bool stopping() {
    std::lock_guard<std::mutex> guard{mtx_};
    return stopping_;
  }

  tls t_;
  cluster_options o_;
  caf::actor_system* sys_ = nullptr;
  mutable std::mutex mtx_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool watch_ = false;
  membership core_;
  std::map<std::string, caf::actor> handles_;  ///< the members' node actors
  std::vector<std::weak_ptr<cluster_follower>> followers_;
  std::deque<std::shared_ptr<batch>> queue_;
  std::shared_ptr<leaving_sink> sink_ = std::make_shared<leaving_sink>();
  caf::actor listener_;  ///< hears members that drain themselves (watching clusters only)
};

/// The clusters alive in this process, for observers (cluster_views).
struct cluster_registry {
  std::mutex mtx;
  std::uint64_t next_id = 1;
  std::vector<std::pair<std::uint64_t, std::weak_ptr<cluster_core>>> live;
};

cluster_registry& registry() {
  static cluster_registry r;
  return r;
}

/// A cluster's shared state: the core, and the threads that hold it. Its end stops them and
/// waits for them (when it ends on one of them, in on_change, that one finishes by itself).
class cluster_state {
 public:
  cluster_state(tls t, cluster_options o, bool watch)
      : core(std::make_shared<cluster_core>(std::move(t), std::move(o), watch)) {
    {
      auto& r = registry();
      std::lock_guard<std::mutex> guard{r.mtx};
      r.live.erase(std::remove_if(r.live.begin(), r.live.end(),
                                  [](const auto& x) { return x.second.expired(); }),
                   r.live.end());
      r.live.emplace_back(r.next_id++, core);
    }
    notifier_ = std::thread{[c = core] { c->notify_loop(); }};
    if (core->watching()) watcher_ = std::thread{[c = core] { c->guarded_watch_loop(); }};
    if (core->reconnecting())
      reconnector_ = std::thread{[c = core] { c->guarded_reconnect_loop(); }};
  }
  cluster_state(const cluster_state&) = delete;
  cluster_state& operator=(const cluster_state&) = delete;
  ~cluster_state() {
    core->stop();
    for (auto* t : {&watcher_, &reconnector_, &notifier_}) {
      if (!t->joinable()) continue;
      if (t->get_id() == std::this_thread::get_id())
        t->detach();  // the last copy ended in on_change: the notifier ends by itself
      else
        t->join();
    }
  }

  const std::shared_ptr<cluster_core> core;

 private:
  std::thread notifier_, watcher_, reconnector_;
};

std::vector<cluster_view> cluster_views() {
  std::vector<std::pair<std::uint64_t, std::shared_ptr<cluster_core>>> live;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> guard{r.mtx};
    for (auto& [id, w] : r.live)
      if (auto c = w.lock()) live.emplace_back(id, std::move(c));
  }
  std::vector<cluster_view> out;
  for (auto& [id, c] : live) out.push_back(cluster_view{id, c->members(), c->fenced_answers()});
  return out;
}

cluster_snapshot follow(const std::shared_ptr<cluster_state>& c,
                        const std::shared_ptr<cluster_follower>& f) {
  if (!c) throw invalid_argument("a runner needs a connected cluster (cluster::connect)");
  return c->core->follow(f);
}

}  // namespace troupe::detail

namespace troupe {

namespace {

cluster_options unwatched(std::chrono::milliseconds deadline) {
  cluster_options o;
  o.reconnect = false;
  o.connect_timeout = deadline;
  return o;
}

}  // namespace

cluster cluster::connect(const std::vector<std::string>& nodes, tls t,
                         std::chrono::milliseconds deadline) {
  if (deadline.count() <= 0)
    throw invalid_argument("cluster::connect: the deadline must be positive");
  if (nodes.empty()) throw invalid_argument("cluster::connect needs at least one HOST:PORT");
  cluster c{std::make_shared<detail::cluster_state>(std::move(t), unwatched(deadline), false)};
  for (auto& address : nodes) c.state_->core->join(address, false);
  return c;
}

cluster cluster::connect(const std::vector<std::string>& nodes, tls t, cluster_options o) {
  detail::check(o);
  if (nodes.empty()) throw invalid_argument("cluster::connect needs at least one HOST:PORT");
  cluster c{std::make_shared<detail::cluster_state>(std::move(t), std::move(o), true)};
  for (auto& address : nodes) c.state_->core->join(address, false);
  return c;
}

void cluster::add(const std::string& node) {
  if (!state_) throw invalid_argument("cluster::add on a cluster that is not connected");
  state_->core->join(node, true);
}

void cluster::remove(const std::string& node) {
  if (!state_) throw invalid_argument("cluster::remove on a cluster that is not connected");
  state_->core->remove(node);
}

std::vector<device> cluster::devices() const {
  return state_ ? state_->core->devices() : std::vector<device>{};
}

std::vector<std::string> cluster::nodes() const {
  return state_ ? state_->core->nodes() : std::vector<std::string>{};
}

std::vector<member> cluster::members() const {
  return state_ ? state_->core->members() : std::vector<member>{};
}

std::size_t cluster::fenced_answers() const {
  return state_ ? state_->core->fenced_answers() : 0;
}

const tls& cluster::tls_settings() const {
  static const tls none;
  return state_ ? state_->core->settings() : none;
}

}  // namespace troupe
