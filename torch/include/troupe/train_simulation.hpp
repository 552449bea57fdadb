// Simulated training for users' tests (docs/api.md, "Simulated training"): data_parallel on a
// simulation's nodes, in virtual time, on the calling thread. The job's own replica code runs
// (LibTorch on the CPU), one replica per simulated device, constructed one at a time; shards
// are planned, recovered and summed by the coordinator core data_parallel runs
// (torch/src/train_coordinator.hpp) and each replica computes and applies them with the real
// replica code, so the parameters are the ones data_parallel gives. Time, nodes and faults are
// simulated:
//
//   troupe::testing::simulation sim{42};
//   sim.nodes({"a:1", "b:1", "c:1"}, troupe::cpus(1));
//   sim.at_step(3).at_shard(2).kill("a:1");
//   sim.at_step(6).freeze("b:1", std::chrono::seconds{5});
//   auto dp = sim.data_parallel<my_job>(sim.devices(), cfg, o);
//   for (auto& b : batches) dp.step(b);
//   EXPECT_TRUE(same_bits(dp.parameters(), no_fault));
//
// Rings among replicas are simulated with the real ring's arithmetic (docs/api.md). What is not
// simulated: nodes that join or come back, the network's own failures (a fault is a node's),
// and time spent in the replica's code (virtual time is cost_per_item per sample).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "troupe/simulation.hpp"
#include "troupe/train.hpp"

namespace troupe {
namespace detail {

/// The simulated coordinator (torch/src/train_sim.cpp): replicas by `make`.
class sim_trainer {
 public:
  sim_trainer(const testing::simulation& sim, std::vector<device> devices, config cfg,
              train_options o, replica_maker make);
  sim_trainer(sim_trainer&&) noexcept;
  sim_trainer& operator=(sim_trainer&&) noexcept;
  ~sim_trainer();
  double step(const batch& samples, bool local = false);
  void average_parameters();
  std::vector<at::Tensor> parameters();
  std::vector<at::Tensor> replica_parameters();
  [[nodiscard]] std::vector<device> devices() const;
  [[nodiscard]] train_stats stats() const;
  [[nodiscard]] std::string trace() const;
  [[nodiscard]] std::chrono::nanoseconds now() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace detail
}  // namespace troupe

namespace troupe::testing {

/// data_parallel<Job> on a simulation (what sim.data_parallel<Job>(...) returns): the same
/// step(), parameters(), replica_parameters(), devices() and stats(), and the simulation's
/// trace of the training.
template <class Job>
class simulated_data_parallel {
  using traits = troupe::detail::replica_traits<Job>;

 public:
  using sample_type = typename traits::sample_type;

  simulated_data_parallel(const simulation& sim, std::vector<device> devices, config cfg = {},
                          train_options o = {})
      : t_(sim, std::move(devices), std::move(cfg), o, &troupe::detail::replica_impl<Job>::create) {
  }

  /// One synchronous step, as data_parallel::step: returns the batch's mean loss; throws
  /// node_error when every replica was lost, work_error when a backward threw.
  double step(const std::vector<sample_type>& samples) { return t_.step(batch::of(samples)); }
  /// As data_parallel::local_step: each replica steps on the mean gradient of its own shards
  /// (an even split), with no reduction; returns the mean loss of the samples whose replica
  /// was not lost.
  double local_step(const std::vector<sample_type>& samples) {
    return t_.step(batch::of(samples), true);
  }
  /// As data_parallel::average_parameters: every replica gets the mean of the parameters.
  void average_parameters() { t_.average_parameters(); }
  std::vector<at::Tensor> parameters() { return t_.parameters(); }
  std::vector<at::Tensor> replica_parameters() { return t_.replica_parameters(); }
  [[nodiscard]] std::vector<device> devices() const { return t_.devices(); }
  [[nodiscard]] train_stats stats() const { return t_.stats(); }
  /// Every event of the training so far, one per line with its virtual time: shards sent and
  /// answered, faults, losses, recomputations, steps. The same seed and script give the same.
  [[nodiscard]] std::string trace() const { return t_.trace(); }
  /// Virtual time of the training.
  [[nodiscard]] std::chrono::nanoseconds now() const { return t_.now(); }

 private:
  troupe::detail::sim_trainer t_;
};

template <class Job, class... Args>
simulated_data_parallel<Job> simulation::data_parallel(std::vector<device> devices,
                                                       Args&&... args) {
  return simulated_data_parallel<Job>{*this, std::move(devices), std::forward<Args>(args)...};
}

/// What explore_training() draws its simulations from.
struct explore_training_options {
  std::size_t seeds = 200;
  std::size_t nodes = 3;
  std::uint64_t first_seed = 0;
  std::chrono::nanoseconds cost_per_item{std::chrono::microseconds{100}};
  bool faults = true;  ///< draw kills, freezes past the timeout and slow nodes (else timing)
  config cfg;
  train_options opts;
};

/// Draws `eo.nodes` nodes of one CPU each and, with faults, for `seed`: up to nodes - 1 of them
/// killed or frozen past the timeout at a random step and shard, others slowed (faults that
/// training promises to survive: one node is never lost).
void draw_training(simulation& sim, const explore_training_options& eo, std::size_t steps);

/// Trains `Job` over `batches` (one step each) in `eo.seeds` simulations with random faults and
/// timing, and returns the first seed whose outcome (the parameters of replica 0, or what a
/// step threw) fails `check`, with its trace; nothing when all pass.
template <class Job, class Batches, class Check>
std::optional<found_failure> explore_training(const Batches& batches, Check&& check,
                                              explore_training_options eo = {}) {
  for (std::uint64_t seed = eo.first_seed; seed < eo.first_seed + eo.seeds; ++seed) {
    simulation sim{seed};
    draw_training(sim, eo, batches.size());
    outcome<std::vector<at::Tensor>> o;
    std::string trace;
    try {
      auto dp = sim.data_parallel<Job>(sim.devices(), eo.cfg, eo.opts);
      try {
        for (auto& b : batches) dp.step(b);
        o.value = dp.parameters();
      } catch (...) {
        o.error = std::current_exception();
      }
      trace = dp.trace();
    } catch (...) {
      o.error = std::current_exception();
    }
    if (!check(static_cast<const outcome<std::vector<at::Tensor>>&>(o)))
      return found_failure{seed, trace};
  }
  return std::nullopt;
}

}  // namespace troupe::testing
