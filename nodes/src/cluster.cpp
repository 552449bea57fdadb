// A live cluster (docs/api.md, "Pools that change"): the shell around the membership part
// (membership.hpp). Three threads of its own, which share its core (cluster_core.hpp): a watcher
// and a reconnector (cluster_watch.cpp), and a notifier (cluster_notify.cpp). Neither probing
// nor reconnecting ever waits on a runner. Here: the clusters alive (cluster_views), the
// threads' start and end, and troupe::cluster.
#include <algorithm>
#include <mutex>
#include <thread>

#include "cluster_core.hpp"
#include "troupe/error.hpp"

namespace troupe::detail {

namespace {

void check(const cluster_options& o) {
  if (o.reconnect_every.count() <= 0 || o.connect_timeout.count() <= 0 ||
      o.heartbeat.count() <= 0 || o.lost_after.count() <= 0)
    throw invalid_argument("cluster_options: every duration must be positive");
  constexpr auto day = std::chrono::hours{24};  // beyond it, now + a duration could overflow
  if (o.reconnect_every > day || o.connect_timeout > day || o.heartbeat > day ||
      o.lost_after > day || o.discover_every > day)
    throw invalid_argument("cluster_options: no duration may be longer than a day");
  if (o.lost_after <= o.heartbeat)
    throw invalid_argument("cluster_options: lost_after must be longer than heartbeat");
  if (o.discover && o.discover_every.count() <= 0)
    throw invalid_argument("cluster_options: discover_every must be positive");
}

}  // namespace

/// The clusters alive in this process, for observers (cluster_views).
struct cluster_registry {
  std::mutex mtx;
  std::uint64_t next_id = 1;
  std::vector<std::pair<std::uint64_t, std::weak_ptr<cluster_core>>> live;
};

cluster_registry& registry() {
  static auto& r = *new cluster_registry;  // never destroyed: see network_system()
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
    auto& opts = core->options();
    if (core->watching())
      watcher_ = std::thread{[c = core, every = opts.heartbeat] {
        c->guarded("cluster watcher", &cluster_core::watch_loop, every);
      }};
    if (core->watching())
      downs_ = std::thread{[c = core] {
        c->guarded("cluster downs", &cluster_core::downs_loop, std::chrono::milliseconds{100});
      }};
    if (core->reconnecting())
      reconnector_ = std::thread{[c = core, every = opts.reconnect_every] {
        c->guarded("cluster reconnector", &cluster_core::reconnect_loop, every);
      }};
    if (core->discovering())
      discoverer_ = std::thread{[c = core, every = opts.discover_every] {
        c->guarded("cluster discovery", &cluster_core::discover_loop, every);
      }};
  }
  cluster_state(const cluster_state&) = delete;
  cluster_state& operator=(const cluster_state&) = delete;
  ~cluster_state() {
    core->stop();
    for (auto* t : {&discoverer_, &downs_, &watcher_, &reconnector_, &notifier_}) {
      if (!t->joinable()) continue;
      if (t->get_id() == std::this_thread::get_id())
        t->detach();  // the last copy ended in on_change: the notifier ends by itself
      else
        t->join();
    }
  }

  const std::shared_ptr<cluster_core> core;

 private:
  std::thread notifier_, watcher_, downs_, reconnector_, discoverer_;
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

std::chrono::milliseconds connect_timeout(const std::shared_ptr<cluster_state>& c) {
  return c ? c->core->options().connect_timeout : cluster_options{}.connect_timeout;
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
  if (deadline.count() <= 0 || deadline > std::chrono::hours{24})
    throw invalid_argument("cluster::connect: the deadline must be positive, at most a day");
  if (nodes.empty()) throw invalid_argument("cluster::connect needs at least one HOST:PORT");
  cluster c{std::make_shared<detail::cluster_state>(std::move(t), unwatched(deadline), false)};
  for (auto& address : nodes) c.state_->core->join(address, false);
  return c;
}

cluster cluster::connect(const std::vector<std::string>& nodes, tls t, cluster_options o) {
  detail::check(o);
  if (nodes.empty() && !o.discover)
    throw invalid_argument("cluster::connect needs at least one HOST:PORT (or discover)");
  cluster c{std::make_shared<detail::cluster_state>(std::move(t), std::move(o), true)};
  c.state_->core->connect_all(nodes);
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
  static const auto& none = *new tls;  // never destroyed: see network_system()
  return state_ ? state_->core->settings() : none;
}

}  // namespace troupe
