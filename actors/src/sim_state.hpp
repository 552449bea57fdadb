// The state of a simulated cluster (troupe::testing::simulation, actors/src/simulation.cpp):
// its actor system on the test coordinator, its nodes and faults, its trace, and the loop that
// runs it. The simulated producers are in sim_producer.cpp.
#pragma once

#include <algorithm>
#include <atomic>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <caf/send.hpp>
#include <cstdio>
#include <limits>
#include <map>
#include <random>

#include "producer_state.hpp"
#include "runtime_impl.hpp"
#include "troupe/detail/network.hpp"
#include "troupe/error.hpp"
#include "troupe/log.hpp"
#include "troupe/protocol.hpp"
#include "troupe/simulation.hpp"

namespace troupe::detail {

using sim_answer_atom = caf::atom_constant<caf::atom("simanswer")>;
using sim_event_atom = caf::atom_constant<caf::atom("simevent")>;
using sim_clock = std::chrono::steady_clock;

/// limits::idle_timeout's default: a node silent this long is lost (heartbeats).
inline constexpr std::chrono::milliseconds heartbeat_loss{1500};

enum fault_kind : int {
  kill_fault,
  freeze_fault,
  slow_fault,
  partition_fault,
  heal_fault,
  delay_fault,
  drain_fault
};

inline const char* fault_name(int k) {
  static const char* names[] = {"kill", "freeze", "slow", "partition", "heal", "delay", "drain"};
  return names[k];
}

struct sim_node {
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

struct sim_chunk_fault {
  std::string node;
  std::size_t chunk;
  int kind;
  double value;
};

class sim_state;

struct sim_producer_state {
  sim_state* sim = nullptr;
  device where;  ///< on its node ("a:1/cpu")
  std::string node;
  sim_node* at = nullptr;  ///< its node (nodes_ is a std::map: the entry stays put)
  /// The job's producer on the local device, run as a real producer actor runs it.
  producer_state real;
  sim_clock::time_point busy_until{};
  std::uint64_t next_answer = 0;
  std::map<std::uint64_t, std::pair<caf::response_promise, chunk_result>> answers;
};

caf::behavior sim_producer(caf::event_based_actor* self, std::shared_ptr<sim_producer_state> st);

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
    // Handles may outlive the simulation: their jobs end now, and they let go of its actors.
    for (auto& weak : jobs_)
      if (auto c = weak.lock()) {
        if (!c->done())
          c->finish(std::make_exception_ptr(
              runner_closed("the simulation ended before this job did (troupe::testing)")));
        c->detach_actors();
      }
    // Nothing of a job still running may be touched now (its caller's range may be gone): the
    // schedulers only end, whatever messages they still have.
    halted_->store(true);
    caf::anon_send_exit(director_, caf::exit_reason::user_shutdown);
    for (auto& a : owned_) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    for (auto& [name, n] : nodes_)
      for (auto& p : n.producers) caf::anon_send_exit(p, caf::exit_reason::user_shutdown);
    sched_.run();
    clear_internal_thread();
  }

  caf::actor_system& system() override { return sys_; }

  void own(caf::actor a) override {
    // The scheduler as the test coordinator sees it: timed when it runs (drive()).
    if (auto* r = dynamic_cast<caf::resumable*>(caf::actor_cast<caf::abstract_actor*>(a)))
      schedulers_.push_back(r);
    owned_.push_back(std::move(a));
  }
  std::shared_ptr<std::atomic<bool>> halted() override { return halted_; }
  [[nodiscard]] planted_bug planted() const override { return planted_; }
  /// Plants `b` in the schedulers of the runners made after this (sim_access::plant).
  void plant(planted_bug b) { planted_ = b; }

  caf::actor spawn_producer(producer_maker make, const device& d, const config& cfg,
                            std::size_t index, bool serialize) override {
    auto st = std::make_shared<sim_producer_state>();
    st->sim = this;
    st->where = d;
    st->node = d.node();
    st->real.make = make;
    st->real.where = d.local();
    st->real.cfg = cfg;
    st->real.index = index;
    st->real.serialize = serialize;
    auto a = sys_.spawn(sim_producer, st);
    auto& n = nodes_[st->node];
    st->at = &n;
    n.producers.push_back(a);
    return a;
  }

  void drive(const std::function<bool()>& until,
             std::chrono::nanoseconds at_most = std::chrono::nanoseconds::max()) override {
    auto instant = sched_.clock().now();
    auto stop_at = at_most == std::chrono::nanoseconds::max() ||
                           instant.time_since_epoch() > sim_clock::duration::max() - at_most
                       ? sim_clock::time_point::max()
                       : instant + at_most;
    std::size_t steps = 0;  // at this virtual instant
    for (;;) {
      if (stuck_ || until()) break;
      if (auto t = sched_.clock().now(); t != instant) {
        instant = t;
        steps = 0;
      } else if (++steps > livelock_after_) {
        stuck_ = true;
        record("livelock: " + std::to_string(livelock_after_) +
               " events at one virtual instant; the simulation is stopped");
        break;
      }
      if (sched_.has_job()) {
        auto n = sched_.jobs.size();
        if (n > 1) {
          // The next to run: one picked at random, swapped to the front (a rotate moved every
          // actor before it: a step cost as much as the actors ready, thousands at scale).
          auto k = std::uniform_int_distribution<std::size_t>(0, n - 1)(rng_);
          std::swap(sched_.jobs.front(), sched_.jobs[k]);
        }
        auto* next = sched_.jobs.front();
        if (std::find(schedulers_.begin(), schedulers_.end(), next) != schedulers_.end()) {
          auto t0 = std::chrono::steady_clock::now();
          sched_.run_once();
          scheduler_time_ += std::chrono::steady_clock::now() - t0;
          scheduler_runs_ += 1;
        } else {
          sched_.run_once();
        }
        clear_internal_thread();  // the job's code ran on this thread; the caller's waits may
        continue;                 // run the simulation again
      }
      if (!sched_.has_pending_timeout() || elapsed() >= limit_ || instant >= stop_at) break;
      sched_.trigger_timeout();
    }
  }

  void adopt(const std::shared_ptr<job_core>& job) override {
    std::weak_ptr<sim_state> weak = self_;
    job->set_driver([weak](const std::function<bool()>& until, std::chrono::nanoseconds at_most) {
      if (auto s = weak.lock()) s->drive(until, at_most);
    });
    auto id = job->id();
    job->on_finish([weak, id, w = std::weak_ptr<job_core>(job)] {
      auto s = weak.lock();
      auto c = w.lock();
      if (!s || !c) return;
      s->live_ -= 1;
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
      s->record("job " + std::to_string(id) + " ended: " + how);
    });
    live_ += 1;
    // Kept to let the handles go of this simulation's actors when it ends; ended ones are
    // dropped as the list doubles, so that many short jobs cost nothing here.
    if (jobs_.size() >= 2 * prune_at_) {
      jobs_.erase(std::remove_if(jobs_.begin(), jobs_.end(),
                                 [](auto& w) {
                                   auto c = w.lock();
                                   return !c || c->done();
                                 }),
                  jobs_.end());
      prune_at_ = std::max<std::size_t>(64, jobs_.size());
    }
    jobs_.push_back(job);
    record("job " + std::to_string(id) + " submitted");
  }

  // -- the public side --------------------------------------------------------------------

  [[nodiscard]] testing::simulation::scheduler_cost scheduler_time() const {
    return {scheduler_time_, scheduler_runs_};
  }

  std::weak_ptr<sim_state> self_;
  std::vector<device> devices_;
  std::chrono::nanoseconds cost_{std::chrono::microseconds{100}};
  double jitter_ = 0.5;
  std::chrono::nanoseconds limit_{std::chrono::hours{1}};
  std::size_t& livelock_after() { return livelock_after_; }
  std::map<std::size_t, std::vector<std::uint64_t>> throws_;  ///< producer index -> items
  std::vector<sim_chunk_fault> chunk_faults_;
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

  sim_node& node(const std::string& name) {
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
      case drain_fault:
        // node::drain (SIGTERM): each runner hears that the node's producers are leaving, as
        // from a real node; they finish their chunks and end (removed, never lost).
        record(what);
        for (auto& s : owned_) caf::anon_send(s, leaving_atom::value, n.producers);
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
    drive([&] { return live_ == 0 && !sched_.has_job(); });
    if (live_ == 0) return true;
    record("hang: " + std::to_string(live_) + " job(s) still running and nothing is left to run" +
           (elapsed() >= limit_ ? " before the time limit" : "") + (stuck_ ? " (livelock)" : ""));
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

  std::unique_ptr<caf::actor_system_config> cfg_;
  caf::actor_system sys_;
  caf::scheduler::test_coordinator& sched_;
  sim_clock::time_point start_;
  caf::actor director_;
  std::map<std::uint64_t, std::function<void()>> events_;
  std::uint64_t next_event_ = 1;
  std::map<std::string, sim_node> nodes_;
  std::vector<std::weak_ptr<job_core>> jobs_;
  std::size_t prune_at_ = 64;
  std::size_t live_ = 0;                           ///< jobs submitted and not ended
  std::vector<caf::actor> owned_;                  ///< the runners' schedulers
  std::vector<const caf::resumable*> schedulers_;  ///< the same, as the coordinator runs them
  std::chrono::nanoseconds scheduler_time_{0};     ///< spent running them (simulation.hpp)
  std::uint64_t scheduler_runs_ = 0;
  std::shared_ptr<std::atomic<bool>> halted_ = std::make_shared<std::atomic<bool>>(false);
  planted_bug planted_ = planted_bug::none;
  std::string trace_;
  /// A simulation that keeps running events without its clock advancing is livelocked: stopped,
  /// and its jobs reported as hung.
  std::size_t livelock_after_ = 1'000'000;
  bool stuck_ = false;

 public:
  sim_node& node_of(const sim_producer_state& st) { return *st.at; }
};

inline sim_state& sim_of(const std::shared_ptr<sim_host>& host) {
  return static_cast<sim_state&>(*host);
}

}  // namespace troupe::detail
