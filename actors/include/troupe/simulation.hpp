// Simulated clusters for users' tests (docs/api.md, "Simulated clusters"): the same runners
// (submit, run, stream, options, errors) on simulated devices and nodes, in virtual time, on
// the calling thread, the same trace for the same seed. The job's own producer and consumer
// code runs; time, the network and faults are simulated; troupe's real scheduler decides.
//
//   troupe::testing::simulation sim{42};
//   sim.nodes({"a:1", "b:1", "c:1", "d:1"}, troupe::cpus(2));
//   sim.cost_per_item(std::chrono::microseconds(100));
//   auto r = sim.ordered_runner<my_job>(sim.devices());
//   sim.at_chunk(3).kill("a:1");
//   EXPECT_EQ(r.run(inputs), expected);        // get() runs the simulation until the job ends
//
//   auto f = troupe::testing::explore<my_job>(inputs, [&](auto& o) { return o.value == expected;
//   });
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "troupe/config.hpp"
#include "troupe/detail/job_core.hpp"
#include "troupe/detail/runtime.hpp"
#include "troupe/device.hpp"
#include "troupe/options.hpp"
#include "troupe/outcome.hpp"
#include "troupe/runner.hpp"

namespace troupe::detail {
struct sim_access;  // what tests reach inside a simulation (actors/src/sim_access.hpp)
}  // namespace troupe::detail

namespace troupe::testing {

class simulation;

/// A moment of a fault script: `sim.at_chunk(3)` (a node's 3rd chunk arrives: that chunk meets
/// the fault) or `sim.after(5ms)` (virtual time from now). The call on it names the fault.
class fault_at {
 public:
  /// The node's process dies: its producers are lost, their chunks go to the others.
  void kill(const std::string& node);
  /// The node drains (node::drain, SIGTERM): every runner's producers there take no new work,
  /// finish their chunks and end (removed, never lost; their outputs are delivered).
  void drain(const std::string& node);
  /// The node stops answering for `d`. A freeze of limits::idle_timeout (1.5 s) or more is
  /// noticed by heartbeats then: the node is lost, as in a kill; a shorter one only delays.
  void freeze(const std::string& node, std::chrono::nanoseconds d);
  /// Its producers take `factor` times as long per item from now on.
  void slow(const std::string& node, double factor);
  /// Cut off until heal(): like a freeze that has no end of its own.
  void partition(const std::string& node);
  /// Ends a partition or freeze (if the node was not lost meanwhile).
  void heal(const std::string& node);
  /// Its answers take `d` longer to arrive from now on (a slow link).
  void delay(const std::string& node, std::chrono::nanoseconds d);

 private:
  friend class simulation;
  fault_at(std::shared_ptr<detail::sim_host> host, std::size_t chunk,
           std::chrono::nanoseconds after)
      : host_(std::move(host)), chunk_(chunk), after_(after) {}
  void add(int kind, const std::string& node, double value);
  std::shared_ptr<detail::sim_host> host_;
  std::size_t chunk_;               ///< 0: at a time
  std::chrono::nanoseconds after_;  ///< from the moment it was scripted
};

/// The producer at one index of the runners' device lists (every runner of the simulation).
class producer_script {
 public:
  /// Its work() throws on input item `item` (0-based, the job's input order), each time that
  /// producer is asked to run it; another producer runs it fine (for retries).
  void throws_at_item(std::uint64_t item);

 private:
  friend class simulation;
  producer_script(std::shared_ptr<detail::sim_host> host, std::size_t index)
      : host_(std::move(host)), index_(index) {}
  std::shared_ptr<detail::sim_host> host_;
  std::size_t index_;
};

/// A fault of simulated training (sim.data_parallel, <troupe/train_simulation.hpp>).
struct step_fault {
  enum kind_t : int { kill, freeze, slow };
  std::size_t step = 0;   ///< 1-based: the step() call it happens in
  std::size_t shard = 0;  ///< 1-based: the node's shard of that step it happens at
  kind_t kind = kill;
  std::string node;
  double value = 0;  ///< freeze: nanoseconds; slow: the factor
  /// In the step's ring all-reduce, halfway through (step_fault_at::in_ring); a step with no
  /// ring has it right after the step.
  bool in_ring = false;
};

/// A moment of a training fault script: `sim.at_step(3).at_shard(2).kill("a:1")`: the node dies
/// as it computes its 2nd shard of step 3 (or at the end of its work in that step, if it has
/// fewer); without at_shard, at its first.
class step_fault_at {
 public:
  [[nodiscard]] step_fault_at at_shard(std::size_t n) const;
  /// Halfway through the step's ring all-reduce (replicas on nodes, gradients of 256 KiB or
  /// more, fast mode); right after the step when it has no ring.
  [[nodiscard]] step_fault_at in_ring() const;
  /// The node's process dies: its replicas are lost, their shards recomputed by the others.
  void kill(const std::string& node);
  /// The node stops answering for `d`: dropped once train_options::replica_timeout (or, without
  /// one, limits::idle_timeout, 1.5 s) passes before it answers; a shorter freeze only delays.
  void freeze(const std::string& node, std::chrono::nanoseconds d);
  /// Its replicas take `factor` times as long per shard from that moment on.
  void slow(const std::string& node, double factor);

 private:
  friend class simulation;
  step_fault_at(std::shared_ptr<std::vector<step_fault>> to, std::vector<std::string> nodes,
                std::size_t step, std::size_t shard, bool ring = false)
      : to_(std::move(to)), nodes_(std::move(nodes)), step_(step), shard_(shard), ring_(ring) {}
  void add(step_fault::kind_t kind, const std::string& node, double value);
  std::shared_ptr<std::vector<step_fault>> to_;
  std::vector<std::string> nodes_;
  std::size_t step_, shard_;
  bool ring_ = false;
};

template <class Job>
class simulated_data_parallel;  // <troupe/train_simulation.hpp>

/// What explore() draws its simulations from.
struct explore_options {
  std::size_t seeds = 1000;
  std::size_t nodes = 4;
  std::size_t producers_per_node = 2;
  bool ordered = false;  ///< which runner
  std::uint64_t first_seed = 0;
  std::chrono::nanoseconds cost_per_item{std::chrono::microseconds{100}};
  bool faults = true;  ///< draw kills, drains, freezes, slow nodes and slow links (else timing)
  config cfg;
  options opts;
};

/// What a job gave in one simulation: its value, or what get() threw (troupe::outcome).
template <class R>
using outcome = troupe::outcome<R>;

/// The first seed whose check failed, with that simulation's trace.
struct found_failure {
  std::uint64_t seed = 0;
  std::string trace;
};

class simulation {
 public:
  /// Everything random in the simulation (per-chunk time jitter, the order in which actors that
  /// are ready at the same virtual moment run, explore()'s faults) comes from `seed`.
  explicit simulation(std::uint64_t seed = 0);
  ~simulation();
  simulation(const simulation&) = delete;
  simulation& operator=(const simulation&) = delete;

  /// Adds nodes ("host:port" names), each with the devices `per_node` (e.g. troupe::cpus(2)).
  void nodes(const std::vector<std::string>& names, const std::vector<device>& per_node);
  /// Every simulated device: "a:1/cpu" and so on, in the order the nodes were added.
  [[nodiscard]] std::vector<device> devices() const;
  /// Virtual time a producer spends per item (default 100 us), before jitter and slow().
  void cost_per_item(std::chrono::nanoseconds d);
  /// Each chunk's time is scaled by a factor drawn from [1, 1 + j) (default 0.5).
  void jitter(double j);
  /// A simulation that reaches this virtual time is stopped: a job still running is a hang
  /// (default 1 hour).
  void time_limit(std::chrono::nanoseconds d);
  /// A simulation that runs this many events at one virtual instant is livelocked: stopped, its
  /// jobs hung (default 1,000,000; raise it for a zero cost_per_item or a million jobs
  /// submitted at once).
  void livelock_after(std::size_t events);

  /// The usual runners, on this simulation's devices (devices()).
  template <class Job>
  troupe::ordered_runner<Job> ordered_runner(std::vector<device> devices, config cfg = {},
                                             options opts = {}) {
    return make_runner<troupe::ordered_runner<Job>, Job>(std::move(devices), std::move(cfg),
                                                         std::move(opts));
  }
  template <class Job>
  troupe::unordered_runner<Job> unordered_runner(std::vector<device> devices, config cfg = {},
                                                 options opts = {}) {
    return make_runner<troupe::unordered_runner<Job>, Job>(std::move(devices), std::move(cfg),
                                                           std::move(opts));
  }

  /// Data-parallel training of `Job` on this simulation's devices (<troupe/train_simulation.hpp>,
  /// which defines it): `sim.data_parallel<Job>(sim.devices(), cfg, train_options)`.
  template <class Job, class... Args>
  simulated_data_parallel<Job> data_parallel(std::vector<device> devices, Args&&... args);

  /// Fault scripts: at a node's n-th chunk (1-based), or after `d` of virtual time from now.
  [[nodiscard]] fault_at at_chunk(std::size_t n);
  /// Training fault scripts: in the k-th step() (1-based) of sim.data_parallel.
  [[nodiscard]] step_fault_at at_step(std::size_t k);
  /// What simulated training reads: the seed, the faults scripted with at_step(), the nodes'
  /// names, cost_per_item (per sample) and jitter.
  [[nodiscard]] std::uint64_t seed() const;
  [[nodiscard]] const std::vector<step_fault>& step_faults() const;
  [[nodiscard]] std::vector<std::string> node_names() const;
  [[nodiscard]] std::chrono::nanoseconds item_cost() const;
  [[nodiscard]] double jitter_factor() const;
  [[nodiscard]] fault_at after(std::chrono::nanoseconds d);
  [[nodiscard]] producer_script producer(std::size_t index);

  /// Runs until every job submitted so far has ended and nothing is left to run, advancing
  /// virtual time from timer to timer. False (and a "hang" line in the trace) when a job can
  /// never end: nothing left to run, or the time limit reached, with the job still running.
  bool run_until_idle();
  /// Every event so far, one per line, with its virtual time: chunks, answers, faults, jobs'
  /// ends. The same seed and script give the same trace.
  [[nodiscard]] std::string trace() const;
  /// Virtual time since the simulation began.
  [[nodiscard]] std::chrono::nanoseconds now() const;
  /// Real time this thread spent running the runners' schedulers (their decisions, the
  /// messages they sent), not the simulated producers, consumers or the loop: the scheduler's
  /// own cost, for benchmarks (bench/sim_scale.cpp). `activations`: how many times a scheduler
  /// ran (one or more messages each).
  struct scheduler_cost {
    std::chrono::nanoseconds time{0};
    std::uint64_t activations = 0;
  };
  [[nodiscard]] scheduler_cost scheduler_time() const;

  /// explore(): nodes, costs and random faults for `seed` (ones the runtime promises to
  /// survive: losses and freezes leave at least one node, slow nodes and links).
  void draw(const explore_options& eo);

 private:
  friend struct detail::sim_access;

  template <class Runner, class Job>
  Runner make_runner(std::vector<device> devices, config cfg, options opts) {
    if (opts.serialize) detail::register_wire_types<Job>();  // as a real runner does
    return Runner{detail::runtime_handle{host_, std::move(devices), std::move(cfg), std::move(opts),
                                         &detail::make_producer_ops<Job>}};
  }

  std::shared_ptr<detail::sim_host> host_;
  std::uint64_t seed_ = 0;
  std::shared_ptr<std::vector<step_fault>> step_faults_ =
      std::make_shared<std::vector<step_fault>>();
};

/// Runs `inputs` through `Job` in `eo.seeds` simulations with random faults and timing, and
/// returns the first seed whose outcome fails `check`, with its trace; nothing when all pass.
template <class Job, class Inputs, class Check>
std::optional<found_failure> explore(const Inputs& inputs, Check&& check, explore_options eo = {}) {
  using result = typename detail::job_traits<Job>::result_type;
  for (std::uint64_t seed = eo.first_seed; seed < eo.first_seed + eo.seeds; ++seed) {
    simulation sim{seed};
    sim.draw(eo);
    outcome<result> o;
    try {
      if (eo.ordered) {
        auto r = sim.ordered_runner<Job>(sim.devices(), eo.cfg, eo.opts);
        o.value = r.run(inputs);
      } else {
        auto r = sim.unordered_runner<Job>(sim.devices(), eo.cfg, eo.opts);
        o.value = r.run(inputs);
      }
    } catch (...) {
      o.error = std::current_exception();
    }
    if (!check(static_cast<const outcome<result>&>(o))) return found_failure{seed, sim.trace()};
  }
  return std::nullopt;
}

}  // namespace troupe::testing
