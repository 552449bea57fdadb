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

class cluster_state {
 public:
  cluster_state(tls t, cluster_options o, bool watch)
      : t_(std::move(t)), o_(std::move(o)), core_(o_.lost_after) {
    sys_ = &network_system(t_);
    notifier_ = std::thread{[this] { notify_loop(); }};
    if (watch) {
      listener_ = sys_->spawn(leaving_listener, sink_);
      watcher_ = std::thread{[this] { watch_loop(); }};
      if (o_.reconnect) reconnector_ = std::thread{[this] { reconnect_loop(); }};
    }
  }

  ~cluster_state() {
    if (listener_) caf::anon_send_exit(listener_, caf::exit_reason::user_shutdown);
    {
      std::lock_guard<std::mutex> guard{mtx_};
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto* t : {&watcher_, &reconnector_, &notifier_}) {
      if (!t->joinable()) continue;
      if (t->get_id() == std::this_thread::get_id())
        t->detach();  // the last copy died in on_change: that thread ends by itself
      else
        t->join();
    }
  }

  /// cluster::connect and cluster::add: `joining` a member (add: the first error of the
  /// runners that follow is rethrown).
  void join(const std::string& address, bool rethrow) {
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

  void remove(const std::string& address) {
    std::vector<std::shared_ptr<cluster_follower>> fs;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      auto st = core_.state_of(address);
      if (!st) throw invalid_argument("cluster::remove: " + address + " is not a member");
      if (*st != member::state::up)
        throw invalid_argument("cluster::remove: " + address + " is " + to_string(*st) +
                               ", not up");
      fs = alive_followers();
    }
    for (auto& f : fs)
      if (f->needs(address))
        throw invalid_argument("cluster::remove: " + address +
                               " has the last producers of a runner that follows the cluster: "
                               "add another node first, or close that runner; nothing was "
                               "drained");
    std::shared_ptr<batch> b;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      b = enqueue({core_.begin_drain(address)});  // throws when it is no longer up
      b->removing = true;
    }
    cv_.notify_all();
    b->done.get_future().wait();
  }

  cluster_snapshot follow(const std::shared_ptr<cluster_follower>& f) {
    std::lock_guard<std::mutex> guard{mtx_};
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
    bool removing = false;  ///< cluster::remove's drain (else a node drains on its own word)
  };

  std::vector<device> devices_locked() const {
    std::vector<device> out;
    for (auto& m : core_.members())
      if (m.what == member::state::up) out.insert(out.end(), m.devices.begin(), m.devices.end());
    return out;
  }

  std::vector<std::shared_ptr<cluster_follower>> alive_followers() {
    std::vector<std::shared_ptr<cluster_follower>> out;
    for (auto& w : followers_)
      if (auto f = w.lock()) out.push_back(std::move(f));
    followers_.erase(
        std::remove_if(followers_.begin(), followers_.end(),
                       [](const std::weak_ptr<cluster_follower>& w) { return w.expired(); }),
        followers_.end());
    return out;
  }

  /// Under mtx_: the events go to the runners that follow now.
  std::shared_ptr<batch> enqueue(std::vector<membership_event> events) {
    auto b = std::make_shared<batch>();
    b->events = std::move(events);
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
    for (;;) {
      std::shared_ptr<batch> b;
      {
        std::unique_lock<std::mutex> lock{mtx_};
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping
        b = queue_.front();
        queue_.pop_front();
      }
      for (auto& e : b->events) {
        if (e.what == membership_event::draining && !b->removing) {
          // The node drains itself: it told the coordinators of its producers already.
          report(e);
          continue;
        }
        if (e.what == membership_event::draining) {
          report(e);  // when it begins; the runners drain, then it is drained
          tell(*b, e);
          std::optional<membership_event> d;
          {
            std::lock_guard<std::mutex> guard{mtx_};
            d = core_.end_drain(e.node);
          }
          if (d) {
            tell(*b, *d);
            report(*d);
          }
          continue;
        }
        tell(*b, e);
        report(e);
      }
      b->done.set_value();
    }
  }

  bool pause(std::chrono::milliseconds d) {
    std::unique_lock<std::mutex> lock{mtx_};
    return !cv_.wait_for(lock, d, [&] { return stopping_; });
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
      std::vector<std::pair<caf::node_id, std::uint64_t>> leaving;
      {
        std::lock_guard<std::mutex> guard{sink_->mtx};
        leaving.swap(sink_->notices);
      }
      std::shared_ptr<batch> b;
      {
        std::lock_guard<std::mutex> guard{mtx_};
        auto now = clock::now();
        std::vector<membership_event> events;
        auto add = [&](std::vector<membership_event> more) {
          events.insert(events.end(), more.begin(), more.end());
        };
        for (auto& [where, incarnation] : leaving)
          for (auto& m : core_.members())
            if (auto i = handles_.find(m.address); i != handles_.end() && i->second.node() == where)
              add(core_.answered(m.address, incarnation, m.devices, now, false, true));
        for (auto& x : answers)
          add(core_.answered(x.address, x.hello.incarnation, devices_at(x.address, x.hello.devices),
                             now, false, x.hello.leaving));
        add(core_.tick(now));
        if (!events.empty()) b = enqueue(std::move(events));
      }
      if (b) cv_.notify_all();
      auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - start);
      if (spent < o_.heartbeat && !pause(o_.heartbeat - spent)) return;
    }
  }

  void reconnect_loop() {
    while (pause(o_.reconnect_every)) {
      // Lost members, and members silent for two heartbeats: a node restarted on the same
      // address answers a connect as a new incarnation long before lost_after.
      std::vector<std::string> lost;
      {
        std::lock_guard<std::mutex> guard{mtx_};
        lost = core_.lost();
        auto quiet = core_.silent(clock::now(), 2 * o_.heartbeat);
        lost.insert(lost.end(), quiet.begin(), quiet.end());
      }
      for (auto& address : lost) {
        if (stopping()) return;
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
        std::shared_ptr<batch> b;
        {
          std::lock_guard<std::mutex> guard{mtx_};
          bool fenced = core_.fenced(address, incarnation);
          auto events = core_.answered(address, incarnation, devices_at(address, offered),
                                       clock::now(), false, leaving);
          if (!fenced) {
            handles_[address] = handle;
            watch(handle);
          }
          if (!events.empty()) b = enqueue(std::move(events));
        }
        if (b) cv_.notify_all();
      }
    }
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
  membership core_;
  std::map<std::string, caf::actor> handles_;  ///< the members' node actors
  std::vector<std::weak_ptr<cluster_follower>> followers_;
  std::deque<std::shared_ptr<batch>> queue_;
  std::shared_ptr<leaving_sink> sink_ = std::make_shared<leaving_sink>();
  caf::actor listener_;  ///< hears members that drain themselves (watching clusters only)
  std::thread notifier_, watcher_, reconnector_;
};

cluster_snapshot follow(const std::shared_ptr<cluster_state>& c,
                        const std::shared_ptr<cluster_follower>& f) {
  if (!c) throw invalid_argument("a runner needs a connected cluster (cluster::connect)");
  return c->follow(f);
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
  cluster c;
  c.state_ = std::make_shared<detail::cluster_state>(std::move(t), unwatched(deadline), false);
  for (auto& address : nodes) c.state_->join(address, false);
  return c;
}

cluster cluster::connect(const std::vector<std::string>& nodes, tls t, cluster_options o) {
  detail::check(o);
  if (nodes.empty()) throw invalid_argument("cluster::connect needs at least one HOST:PORT");
  cluster c;
  c.state_ = std::make_shared<detail::cluster_state>(std::move(t), std::move(o), true);
  for (auto& address : nodes) c.state_->join(address, false);
  return c;
}

void cluster::add(const std::string& node) {
  if (!state_) throw invalid_argument("cluster::add on a cluster that is not connected");
  state_->join(node, true);
}

void cluster::remove(const std::string& node) {
  if (!state_) throw invalid_argument("cluster::remove on a cluster that is not connected");
  state_->remove(node);
}

std::vector<device> cluster::devices() const {
  return state_ ? state_->devices() : std::vector<device>{};
}

std::vector<std::string> cluster::nodes() const {
  return state_ ? state_->nodes() : std::vector<std::string>{};
}

std::vector<member> cluster::members() const {
  return state_ ? state_->members() : std::vector<member>{};
}

std::size_t cluster::fenced_answers() const {
  return state_ ? state_->fenced_answers() : 0;
}

const tls& cluster::tls_settings() const {
  static const tls none;
  return state_ ? state_->settings() : none;
}

}  // namespace troupe
