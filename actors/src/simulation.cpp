// troupe::testing::simulation: runners on simulated nodes, in virtual time, on the calling
// thread. The actor system runs on CAF's test coordinator (one thread, a virtual clock): the
// real scheduler actor and the real consumer actors run there unchanged, and each simulated
// producer runs the job's real producer code, then answers after the chunk's virtual cost.
// Which of the actors ready at one virtual moment runs next, and each chunk's jitter, come from
// the seed, so one seed gives one trace.
#include "troupe/simulation.hpp"

#include <algorithm>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <caf/send.hpp>
#include <cstdio>
#include <map>
#include <random>

#include "runtime_impl.hpp"
#include "troupe/detail/messages.hpp"
#include "troupe/detail/network.hpp"
#include "troupe/error.hpp"
#include "troupe/log.hpp"

namespace troupe::detail {
namespace {

using sim_answer_atom = caf::atom_constant<caf::atom("simanswer")>;
using sim_event_atom = caf::atom_constant<caf::atom("simevent")>;
using sim_clock = std::chrono::steady_clock;

/// limits::idle_timeout's default: a node silent this long is lost (heartbeats).
constexpr std::chrono::milliseconds heartbeat_loss{1500};

enum fault_kind : int {
  kill_fault,
  freeze_fault,
  slow_fault,
  partition_fault,
  heal_fault,
  delay_fault
};

const char* fault_name(int k) {
  static const char* names[] = {"kill", "freeze", "slow", "partition", "heal", "delay"};
  return names[k];
}

struct node_state {
  bool dead = false;
  bool frozen = false;
  sim_clock::time_point frozen_until = sim_clock::time_point::max();  ///< max: partitioned
  std::uint64_t freeze_id = 0;  ///< which freeze a heartbeat-loss check belongs to
  double slow = 1;
  std::chrono::nanoseconds delay{0};
  std::size_t chunks = 0;  ///< chunks received so far
  std::vector<caf::actor> producers;
  std::vector<std::pair<caf::actor, std::uint64_t>> held;  ///< answers held while frozen
};

struct chunk_fault {
  std::string node;
  std::size_t chunk;
  int kind;
  double value;
};

class sim_state;

struct producer_slot_state {
  sim_state* sim = nullptr;
  producer_maker make = nullptr;
  device where;
  std::string node;
  config cfg;
  std::size_t index = 0;
  std::unique_ptr<producer_ops> ops;
  sim_clock::time_point busy_until{};
  std::uint64_t next_answer = 0;
  std::map<std::uint64_t, std::pair<caf::response_promise, chunk_result>> answers;
};

caf::behavior sim_producer(caf::event_based_actor* self, std::shared_ptr<producer_slot_state> st);

class sim_state final : public sim_host {
 public:
  explicit sim_state(std::uint64_t seed)
      : cfg_(make_system_config(false)),
        sys_((cfg_->set("scheduler.policy", caf::atom("testing")), *cfg_)),
        sched_(dynamic_cast<caf::scheduler::test_coordinator&>(sys_.scheduler())),
        start_(sched_.clock().now()) {
    rng_.seed(seed);
    sys_.await_actors_before_shutdown(false);
    // With an argument: CAF 0.17.6 dereferences a null pointer spawning a function without one.
    director_ = sys_.spawn(
        [this](caf::event_based_actor*, int) -> caf::behavior {
          return {[this](sim_event_atom, std::uint64_t id) {
            auto i = events_.find(id);
            if (i == events_.end()) return;
            auto f = std::move(i->second);
            events_.erase(i);
            f();
          }};
        },
        0);
  }

  ~sim_state() override {
    caf::anon_send_exit(director_, caf::exit_reason::user_shutdown);
    for (auto& [name, n] : nodes_)
      for (auto& p : n.producers) caf::anon_send_exit(p, caf::exit_reason::user_shutdown);
    sched_.run();
    clear_internal_thread();
  }

  caf::actor_system& system() override { return sys_; }

  caf::actor spawn_producer(producer_maker make, const device& d, const config& cfg,
                            std::size_t index) override {
    auto st = std::make_shared<producer_slot_state>();
    st->sim = this;
    st->make = make;
    st->where = d;
    st->node = d.node();
    st->cfg = cfg;
    st->index = index;
    auto a = sys_.spawn(sim_producer, st);
    nodes_[st->node].producers.push_back(a);
    return a;
  }

  void drive(const std::function<bool()>& until) override {
    for (;;) {
      if (until()) break;
      if (sched_.has_job()) {
        auto n = sched_.jobs.size();
        if (n > 1) {
          auto k = std::uniform_int_distribution<std::size_t>(0, n - 1)(rng_);
          std::rotate(sched_.jobs.begin(), sched_.jobs.begin() + static_cast<std::ptrdiff_t>(k),
                      sched_.jobs.begin() + static_cast<std::ptrdiff_t>(k) + 1);
        }
        sched_.run_once();
        clear_internal_thread();  // the job's code ran on this thread; the caller's waits may
        continue;                 // run the simulation again
      }
      if (!sched_.has_pending_timeout() || elapsed() >= limit_) break;
      sched_.trigger_timeout();
    }
    note_ends();
  }

  void adopt(const std::shared_ptr<job_core>& job) override {
    std::weak_ptr<sim_state> weak = self_;
    job->set_driver([weak](const std::function<bool()>& until) {
      if (auto s = weak.lock()) s->drive(until);
    });
    jobs_.emplace_back(job->id(), job);
    record("job " + std::to_string(job->id()) + " submitted");
  }

  // -- the public side --------------------------------------------------------------------

  std::weak_ptr<sim_state> self_;
  std::vector<device> devices_;
  std::chrono::nanoseconds cost_{std::chrono::microseconds{100}};
  double jitter_ = 0.5;
  std::chrono::nanoseconds limit_{std::chrono::hours{1}};
  std::map<std::size_t, std::vector<std::uint64_t>> throws_;  ///< producer index -> items
  std::vector<chunk_fault> chunk_faults_;
  std::mt19937_64 rng_;

  std::chrono::nanoseconds elapsed() const { return sched_.clock().now() - start_; }

  void record(const std::string& line) {
    char when[32];
    std::snprintf(when, sizeof when, "%12.3f ms  ",
                  std::chrono::duration<double, std::milli>(elapsed()).count());
    trace_ += when;
    trace_ += line;
    trace_ += '\n';
  }

  const std::string& trace() const { return trace_; }

  node_state& node(const std::string& name) {
    auto i = nodes_.find(name);
    if (i == nodes_.end())
      throw invalid_argument("simulation: no node named \"" + name +
                             "\" (add it with simulation::nodes)");
    return i->second;
  }

  void add_node(const std::string& name) {
    if (nodes_.count(name)) throw invalid_argument("simulation: node \"" + name + "\" twice");
    nodes_[name];
  }

  /// Runs `f` after `d` of virtual time.
  void at(std::chrono::nanoseconds d, std::function<void()> f) {
    auto id = next_event_++;
    events_.emplace(id, std::move(f));
    if (d.count() <= 0)
      caf::anon_send(director_, sim_event_atom::value, id);
    else
      caf::delayed_anon_send(director_, d, sim_event_atom::value, id);
  }

  void apply(int kind, const std::string& name, double value) {
    auto& n = node(name);
    if (n.dead) return;
    std::string what = std::string{fault_name(kind)} + " " + name;
    switch (kind) {
      case kill_fault:
        record(what);
        lose(name, "killed");
        return;
      case freeze_fault:
      case partition_fault: {
        auto d = std::chrono::nanoseconds{static_cast<std::int64_t>(value)};
        n.frozen = true;
        auto id = ++n.freeze_id;
        n.frozen_until =
            kind == partition_fault ? sim_clock::time_point::max() : sched_.clock().now() + d;
        record(kind == partition_fault ? what : what + " for " + ms(d));
        if (kind == freeze_fault && d < heartbeat_loss) {
          at(d, [this, name, id] {
            if (node(name).freeze_id == id) thaw(name);
          });
        } else {
          at(heartbeat_loss, [this, name, id] {
            auto& m = node(name);
            if (m.frozen && m.freeze_id == id) {
              record("heartbeats of " + name + " missed for " + ms(heartbeat_loss));
              lose(name, "unreachable");
            }
          });
        }
        return;
      }
      case heal_fault:
        record(what);
        if (n.frozen) thaw(name);
        return;
      case slow_fault:
        n.slow = value;
        record(what + " x" + std::to_string(value));
        return;
      case delay_fault:
        n.delay = std::chrono::nanoseconds{static_cast<std::int64_t>(value)};
        record(what + " " + ms(n.delay));
        return;
      default:
        return;
    }
  }

  /// A chunk arrived at `name`: the faults scripted for that chunk. False: the node died.
  bool chunk_arrived(const std::string& name) {
    auto& n = node(name);
    n.chunks += 1;
    for (auto& f : chunk_faults_)
      if (f.node == name && f.chunk == n.chunks) apply(f.kind, f.node, f.value);
    return !n.dead;
  }

  static std::string ms(std::chrono::nanoseconds d) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f ms", std::chrono::duration<double, std::milli>(d).count());
    return buf;
  }

  double draw_jitter() { return 1 + jitter_ * std::uniform_real_distribution<double>(0, 1)(rng_); }

  sim_clock::time_point clock_now() const { return sched_.clock().now(); }

  bool run_until_idle() {
    auto all_ended = [this] {
      return std::all_of(jobs_.begin(), jobs_.end(), [](auto& j) {
        auto c = j.second.lock();
        return !c || c->done();
      });
    };
    drive([&] { return all_ended() && !sched_.has_job(); });
    if (all_ended()) return true;
    for (auto& [id, weak] : jobs_)
      if (auto c = weak.lock(); c && !c->done())
        record("hang: job " + std::to_string(id) + " is still running and nothing is left to run" +
               (elapsed() >= limit_ ? " before the time limit" : ""));
    return false;
  }

 private:
  void thaw(const std::string& name) {
    auto& n = node(name);
    n.frozen = false;
    n.frozen_until = sim_clock::time_point::max();
    record("thaw " + name);
    auto held = std::move(n.held);
    n.held.clear();
    for (auto& [actor, id] : held) caf::anon_send(actor, sim_answer_atom::value, id);
  }

  void lose(const std::string& name, const char* why) {
    auto& n = node(name);
    n.dead = true;
    n.held.clear();
    record(name + " lost (" + why + ")");
    for (auto& p : n.producers) caf::anon_send_exit(p, caf::exit_reason::remote_link_unreachable);
  }

  void note_ends() {
    for (auto& [id, weak] : jobs_) {
      if (ended_.count(id)) continue;
      auto c = weak.lock();
      if (!c || !c->done()) continue;
      ended_.insert({id, true});
      std::string how = "ok";
      if (auto e = c->error()) {
        try {
          std::rethrow_exception(e);
        } catch (const std::exception& x) {
          how = std::string{"failed: "} + x.what();
        } catch (...) {
          how = "failed";
        }
      }
      record("job " + std::to_string(id) + " ended: " + how);
    }
  }

  std::unique_ptr<caf::actor_system_config> cfg_;
  caf::actor_system sys_;
  caf::scheduler::test_coordinator& sched_;
  sim_clock::time_point start_;
  caf::actor director_;
  std::map<std::uint64_t, std::function<void()>> events_;
  std::uint64_t next_event_ = 1;
  std::map<std::string, node_state> nodes_;
  std::vector<std::pair<std::uint64_t, std::weak_ptr<job_core>>> jobs_;
  std::map<std::uint64_t, bool> ended_;
  std::string trace_;

 public:
  node_state& node_of(const producer_slot_state& st) { return node(st.node); }
};

std::string slot_name(const producer_slot_state& st) {
  return st.where.str() + "#" + std::to_string(st.index);
}

/// The job's real producer code on a chunk, with the scripted throws.
chunk_result run_chunk(producer_slot_state& st, const work_chunk& w) {
  chunk_result r;
  r.run = w.run;
  r.first = w.first;
  batch items = w.items;
  if (auto* lease = w.items.lease()) {
    if (!lease->acquire()) {
      r.code = errc::cancelled;
      r.what = "the job has ended";
      return r;
    }
    items = w.items.owned();
    lease->release();
  }
  if (!st.ops) {
    r.code = errc::protocol_error;
    r.what = "producer on " + st.where.str() + " was not started or has ended";
    return r;
  }
  std::optional<std::uint64_t> throws;
  if (auto t = st.sim->throws_.find(st.index); t != st.sim->throws_.end())
    for (auto k : t->second)
      if (k >= w.first && k < w.first + items.size() && (!throws || k < *throws)) throws = k;
  auto what = [](std::uint64_t k) {
    return "simulated throw at item " + std::to_string(k) + " (producer_script::throws_at_item)";
  };
  if (throws && !w.keep_going) {
    r.code = errc::work_error;
    r.failed_index = *throws;
    r.what = what(*throws);
    return r;
  }
  auto part = [&](std::size_t from, std::size_t to, work_outcome& out) {
    if (from < to) st.ops->work(items.slice(from, to), w.first + from, w.keep_going, out);
  };
  work_outcome out;
  if (!throws) {
    st.ops->work(items, w.first, w.keep_going, out);
  } else {
    auto at = static_cast<std::size_t>(*throws - w.first);
    work_outcome before, after;
    part(0, at, before);
    part(at + 1, items.size(), after);
    out.wrong_type = before.wrong_type || after.wrong_type;
    out.outputs = before.outputs.concat(after.outputs);
    out.failures = std::move(before.failures);
    out.failures.push_back(item_error{*throws, what(*throws)});
    out.failures.insert(out.failures.end(), after.failures.begin(), after.failures.end());
  }
  if (out.wrong_type) {
    r.code = errc::protocol_error;
    r.what = "work chunk holds items of another type than the job's input";
  } else if (out.failed) {
    r.code = errc::work_error;
    r.failed_index = out.failed_index;
    r.what = std::move(out.what);
  } else {
    r.failures = std::move(out.failures);
    r.outputs = std::move(out.outputs);
  }
  return r;
}

caf::behavior sim_producer(caf::event_based_actor* self, std::shared_ptr<producer_slot_state> st) {
  self->attach_functor([st] {
    try {
      if (st->ops) st->ops->destroy();
    } catch (...) {
    }
    st->ops.reset();
  });
  return {
      [st](init_atom) -> caf::result<init_done> {
        try {
          st->ops = st->make(st->where.local(), st->cfg, st->index);
          return init_done{st->where.str()};
        } catch (...) {
          return make_error(errc::init_error,
                            "producer on " + st->where.str() +
                                " failed to start: " + describe_current_exception());
        }
      },
      [self, st](const work_chunk& w) -> caf::result<chunk_result> {
        auto& sim = *st->sim;
        auto range = "job " + std::to_string(w.run) + " items " + std::to_string(w.first) + ".." +
                     std::to_string(w.first + w.items.size());
        if (!sim.chunk_arrived(st->node)) return caf::delegated<chunk_result>{};  // died with it
        sim.record(slot_name(*st) + " got " + range);
        auto r = run_chunk(*st, w);
        auto& n = sim.node_of(*st);
        auto now = sim.clock_now();
        auto cost = std::chrono::duration_cast<std::chrono::nanoseconds>(
            sim.cost_ * static_cast<double>(std::max<std::size_t>(1, w.items.size())) * n.slow *
            sim.draw_jitter());
        auto start = std::max(now, st->busy_until);
        // A frozen node starts it once thawed; a partitioned one works on, its answers held.
        if (n.frozen && n.frozen_until != sim_clock::time_point::max())
          start = std::max(start, n.frozen_until);
        r.idle_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(start - now).count();
        r.busy_ns = cost.count();
        st->busy_until = start + cost;
        auto id = st->next_answer++;
        auto promise = self->make_response_promise<chunk_result>();
        st->answers.emplace(id, std::make_pair(caf::response_promise{promise}, std::move(r)));
        self->delayed_send(self, st->busy_until - now + n.delay, sim_answer_atom::value, id);
        return promise;
      },
      [self, st](sim_answer_atom, std::uint64_t id) {
        auto& sim = *st->sim;
        auto& n = sim.node_of(*st);
        auto i = st->answers.find(id);
        if (i == st->answers.end() || n.dead) return;
        if (n.frozen) {
          n.held.emplace_back(caf::actor_cast<caf::actor>(self), id);
          return;
        }
        auto& [promise, r] = i->second;
        sim.record(slot_name(*st) + " answered job " + std::to_string(r.run) + " items " +
                   std::to_string(r.first) + ".." +
                   std::to_string(r.first + r.outputs.size() + r.failures.size()) +
                   (r.ok() ? std::string{} : " with " + std::string{to_string(r.code)}));
        promise.deliver(std::move(r));
        st->answers.erase(i);
      },
      [st](end_atom) -> caf::result<consume_ack> {
        try {
          if (st->ops) {
            st->ops->end();
            st->ops->destroy();
          }
          st->ops.reset();
          return consume_ack{};
        } catch (...) {
          st->ops.reset();
          return make_error(errc::work_error, "producer::end() on " + st->where.str() +
                                                  " threw: " + describe_current_exception());
        }
      },
  };
}

sim_state& state(const std::shared_ptr<sim_host>& host) {
  return static_cast<sim_state&>(*host);
}

}  // namespace
}  // namespace troupe::detail

namespace troupe::testing {

using detail::state;

void fault_at::add(int kind, const std::string& node, double value) {
  auto& s = state(host_);
  s.node(node);  // throws for an unknown node
  if (chunk_ > 0) {
    s.chunk_faults_.push_back(detail::chunk_fault{node, chunk_, kind, value});
    return;
  }
  auto* sp = &s;
  s.at(after_, [sp, kind, node, value] { sp->apply(kind, node, value); });
}

void fault_at::kill(const std::string& node) {
  add(detail::kill_fault, node, 0);
}
void fault_at::freeze(const std::string& node, std::chrono::nanoseconds d) {
  add(detail::freeze_fault, node, static_cast<double>(d.count()));
}
void fault_at::slow(const std::string& node, double factor) {
  if (!(factor > 0)) throw invalid_argument("simulation: slow() needs a factor above 0");
  add(detail::slow_fault, node, factor);
}
void fault_at::partition(const std::string& node) {
  add(detail::partition_fault, node, 0);
}
void fault_at::heal(const std::string& node) {
  add(detail::heal_fault, node, 0);
}
void fault_at::delay(const std::string& node, std::chrono::nanoseconds d) {
  add(detail::delay_fault, node, static_cast<double>(d.count()));
}

void producer_script::throws_at_item(std::uint64_t item) {
  state(host_).throws_[index_].push_back(item);
}

simulation::simulation(std::uint64_t seed) {
  auto s = std::make_shared<detail::sim_state>(seed);
  s->self_ = s;
  host_ = std::move(s);
}

simulation::~simulation() = default;

void simulation::nodes(const std::vector<std::string>& names, const std::vector<device>& per_node) {
  auto& s = state(host_);
  for (auto& name : names) {
    device probe{name + "/cpu"};  // throws invalid_argument for a malformed name
    if (probe.node() != name)
      throw invalid_argument("simulation: \"" + name + "\" is not a node name (HOST:PORT)");
    s.add_node(name);
    for (auto& d : per_node) {
      if (!d.is_local())
        throw invalid_argument("simulation::nodes: per-node devices are local ones (\"cpu\")");
      s.devices_.emplace_back(name + "/" + d.str());
    }
  }
}

std::vector<device> simulation::devices() const {
  return state(host_).devices_;
}

void simulation::cost_per_item(std::chrono::nanoseconds d) {
  state(host_).cost_ = d;
}

void simulation::jitter(double j) {
  if (!(j >= 0)) throw invalid_argument("simulation: jitter must be at least 0");
  state(host_).jitter_ = j;
}

void simulation::time_limit(std::chrono::nanoseconds d) {
  state(host_).limit_ = d;
}

fault_at simulation::at_chunk(std::size_t n) {
  if (n == 0) throw invalid_argument("simulation::at_chunk counts from 1");
  return fault_at{host_, n, std::chrono::nanoseconds{0}};
}

fault_at simulation::after(std::chrono::nanoseconds d) {
  return fault_at{host_, 0, d};
}

producer_script simulation::producer(std::size_t index) {
  return producer_script{host_, index};
}

bool simulation::run_until_idle() {
  return state(host_).run_until_idle();
}

std::string simulation::trace() const {
  return state(host_).trace();
}

std::chrono::nanoseconds simulation::now() const {
  return state(host_).elapsed();
}

void simulation::draw(const explore_options& eo) {
  auto& s = state(host_);
  if (eo.nodes == 0 || eo.producers_per_node == 0)
    throw invalid_argument("explore_options: at least one node and one producer per node");
  std::vector<std::string> names;
  for (std::size_t i = 0; i < eo.nodes; ++i) names.push_back("n" + std::to_string(i) + ":1");
  nodes(names, cpus(eo.producers_per_node));
  cost_per_item(eo.cost_per_item);
  if (!eo.faults) return;
  auto& rng = s.rng_;
  auto pick = [&](std::size_t n) {
    return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
  };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  // Losses (kills, long freezes, partitions) leave at least one node.
  std::vector<std::string> order = names;
  std::shuffle(order.begin(), order.end(), rng);
  auto losses = pick(eo.nodes);  // 0 .. nodes - 1
  for (std::size_t i = 0; i < losses; ++i) {
    auto& node = order[i];
    switch (pick(3)) {
      case 0:
        at_chunk(1 + pick(4)).kill(node);
        break;
      case 1:
        after(std::chrono::microseconds{pick(20'000)}).freeze(node, std::chrono::seconds{2});
        break;
      default:
        after(std::chrono::microseconds{pick(20'000)}).partition(node);
        break;
    }
  }
  for (std::size_t i = losses; i < order.size(); ++i) {
    auto& node = order[i];
    if (chance(0.3))
      after(std::chrono::microseconds{pick(20'000)})
          .freeze(node, std::chrono::microseconds{1 + pick(1'000'000)});
    if (chance(0.3))
      after(std::chrono::microseconds{pick(20'000)}).slow(node, 2.0 + static_cast<double>(pick(9)));
    if (chance(0.3))
      after(std::chrono::microseconds{pick(20'000)})
          .delay(node, std::chrono::microseconds{pick(5'000)});
  }
}

}  // namespace troupe::testing
