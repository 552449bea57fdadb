// A user's unit test of their training loop against faults (docs/api.md, "Simulated training"):
// the train example's classifier on 3 simulated nodes, in virtual time, on this thread. The
// replica code is the real one (LibTorch on the CPU); nodes, time and faults are simulated.
// Built into the torch test binary (tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <cstring>
#include <troupe/train_simulation.hpp>

#include "common/classifier.hpp"

namespace {

using troupe::testing::simulation;

troupe::config model() {
  troupe::config cfg;
  cfg.set("model.features", 8).set("model.hidden", 16).set("model.classes", 3);
  cfg.set("model.seed", 3).set("sgd.lr", 0.1).set("sgd.momentum", 0.9);
  return cfg;
}

std::vector<std::vector<example::sample>> batches(std::size_t n, std::size_t size) {
  auto data = example::make_data(n * size, 0, 3, 8, 11);
  std::vector<std::vector<example::sample>> out(n);
  for (std::size_t i = 0; i < n * size; ++i) out[i / size].push_back(data.train[i]);
  return out;
}

troupe::train_options deterministic() {
  troupe::train_options o;
  o.shard_size = 8;
  o.deterministic = true;
  o.replica_timeout = std::chrono::seconds{1};
  return o;
}

bool same_bits(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    auto x = a[i].contiguous(), y = b[i].contiguous();
    if (x.sizes() != y.sizes() || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) != 0)
      return false;
  }
  return true;
}

/// 3 nodes of one CPU each; `faults`: one killed at step 3 shard 2, one frozen past the
/// timeout at step 6. Returns the parameters after 10 steps and the trace.
std::pair<std::vector<at::Tensor>, std::string> train(std::uint64_t seed, bool faults) {
  simulation sim{seed};
  sim.nodes({"a:1", "b:1", "c:1"}, troupe::cpus(1));
  if (faults) {
    sim.at_step(3).at_shard(2).kill("a:1");
    sim.at_step(6).freeze("b:1", std::chrono::seconds{5});
  }
  auto dp = sim.data_parallel<example::classifier>(sim.devices(), model(), deterministic());
  for (auto& b : batches(10, 64)) dp.step(b);
  if (faults) {
    EXPECT_EQ(dp.devices(), std::vector<troupe::device>{"c:1/cpu"});
    EXPECT_EQ(dp.stats().lost_replicas, 2u);
    EXPECT_GT(dp.stats().recomputed_shards, 0u);
  }
  return {dp.parameters(), dp.trace()};
}

}  // namespace

TEST(SimulatedTraining, AKilledAndAFrozenNodeLeaveTheParametersBitIdentical) {
  auto [clean, clean_trace] = train(42, false);
  auto [faulty, trace] = train(42, true);
  EXPECT_TRUE(same_bits(faulty, clean)) << trace;
  EXPECT_NE(trace.find("lose a:1/cpu: killed at its shard 2"), std::string::npos) << trace;
  EXPECT_NE(trace.find("lose b:1/cpu: no answer within replica_timeout"), std::string::npos)
      << trace;
  // The same seed, the same events at the same virtual times.
  EXPECT_EQ(train(42, true).second, trace);
  // And the same numbers as data_parallel itself, on one replica in this process.
  troupe::data_parallel<example::classifier> real{{"cpu"}, model(), deterministic()};
  for (auto& b : batches(10, 64)) real.step(b);
  EXPECT_TRUE(same_bits(real.parameters(), clean));
}

namespace {

/// A replica with a mistake users make: state kept across shards (a loss scaled by how many
/// shards this replica has seen). Right on one replica; wrong once shards move between them.
struct stateful_classifier {
  struct replica : example::classifier::replica {
    using example::classifier::replica::replica;
    double backward(const std::vector<example::sample>& shard) {
      seen += 1;
      auto [x, y] = example::stack(shard, features);
      auto loss = torch::nn::functional::cross_entropy(
                      net->forward(x), y,
                      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) *
                  (1.0 + 0.01 * static_cast<double>(seen));
      loss.backward();
      return loss.item<double>();
    }
    std::int64_t seen = 0;
  };
};

template <class Job>
std::optional<troupe::testing::found_failure> explore_against_one_replica() {
  // The reference: the same job on one replica, no faults.
  simulation one{0};
  one.nodes({"r:1"}, troupe::cpus(1));
  auto ref = one.data_parallel<Job>(one.devices(), model(), deterministic());
  auto data = batches(6, 48);
  for (auto& b : data) ref.step(b);
  auto want = ref.parameters();
  troupe::testing::explore_training_options eo;
  eo.seeds = 200;
  eo.cfg = model();
  eo.opts = deterministic();
  return troupe::testing::explore_training<Job>(
      data, [&](const auto& o) { return o.value && same_bits(*o.value, want); }, eo);
}

}  // namespace

TEST(SimulatedTraining, ExploreFindsAReplicaThatKeepsStateAcrossShardsAndPassesACorrectOne) {
  auto bad = explore_against_one_replica<stateful_classifier>();
  ASSERT_TRUE(bad) << "200 seeds did not find the planted mistake";
  EXPECT_FALSE(bad->trace.empty());
  auto good = explore_against_one_replica<example::classifier>();
  EXPECT_FALSE(good) << "seed " << good->seed << ":\n" << good->trace;
}
