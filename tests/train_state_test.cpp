// data_parallel's training state as a PyTorch user expects it (docs/api.md, "Training"): frozen
// parameters that stay still under weight decay, a load() that replaces the optimizer's state
// (a rollback), replicas left identical after a local step on fewer shards than replicas, the
// state kept when the last replica leaves, and checkpoints of another model or optimizer
// refused with nothing changed.
#include <gtest/gtest.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <troupe/train.hpp>
#include <vector>

#include "common/classifier.hpp"
#include "train_checks.hpp"
#include "train_jobs.hpp"

namespace {

using example::sample;
using dp_t = troupe::data_parallel<example::classifier>;

/// Set: every frozen_adamw replica's step() throws.
std::atomic<bool> steps_throw{false};

/// A fine-tuning replica: the first layer frozen (requires_grad false), AdamW with weight decay
/// on all parameters, as `AdamW(model.parameters(), weight_decay=0.1)` over a frozen backbone.
struct frozen_adamw {
  struct replica {
    replica(const troupe::device&, const troupe::config& cfg) {
      example::init_parameters(*net, 3);
      if (cfg.get_or<std::int64_t>("freeze", 1) != 0)
        for (auto& p : net->l1->parameters()) p.requires_grad_(false);
      opt = std::make_unique<torch::optim::AdamW>(
          net->parameters(), torch::optim::AdamWOptions(0.01).weight_decay(0.1));
    }
    std::vector<torch::Tensor> parameters() { return net->parameters(); }
    double backward(const std::vector<sample>& shard) { return summed_loss_backward(net, shard); }
    void step() {
      if (steps_throw) throw std::runtime_error("planted step failure");
      opt->step();
    }
    torch::optim::Optimizer& optimizer() { return *opt; }
    std::shared_ptr<example::mlp_net> net = std::make_shared<example::mlp_net>(8, 16, 3);
    std::unique_ptr<torch::optim::AdamW> opt;
  };
};

/// Two heads: the second joins the logits only for shards holding a sample whose first feature
/// is over 100 (none in the data: a batch reaches it when the test plants one), as a mixture of
/// experts reaches an expert. AdamW with weight decay on every parameter.
struct two_heads {
  struct replica {
    replica(const troupe::device&, const troupe::config&) {
      example::init_parameters(*net, 3);
      example::init_parameters(*aux, 4);
      auto ps = net->parameters();
      for (auto& p : aux->parameters()) ps.push_back(p);
      opt = std::make_unique<torch::optim::AdamW>(
          ps, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
    }
    std::vector<torch::Tensor> parameters() {
      auto ps = net->parameters();
      for (auto& p : aux->parameters()) ps.push_back(p);
      return ps;
    }
    double backward(const std::vector<sample>& shard) {
      auto [x, y] = example::stack(shard, 8);
      auto logits = net->forward(x);
      if (x.select(1, 0).gt(100).any().item<bool>()) logits = logits + aux->forward(x);
      auto loss = torch::nn::functional::cross_entropy(
          logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
      loss.backward();
      return loss.item<double>();
    }
    void step() { opt->step(); }
    torch::optim::Optimizer& optimizer() { return *opt; }
    std::shared_ptr<example::mlp_net> net = std::make_shared<example::mlp_net>(8, 16, 3);
    torch::nn::Linear aux{8, 3};
    std::unique_ptr<torch::optim::AdamW> opt;
  };
};

troupe::config cfg_with(const char* optim) {
  troupe::config cfg;
  cfg.set("model.features", 8).set("model.hidden", 16).set("model.classes", 3);
  cfg.set("model.seed", 3).set("sgd.lr", 0.05).set("optim", std::string{optim});
  return cfg;
}

troupe::train_options deterministic(std::size_t shard = 8) {
  return train_checks::opts(shard, true);
}

using train_checks::flat;
using train_checks::same_bits;

template <class DataParallel>
void expect_identical(DataParallel& dp) {
  train_checks::expect_replicas_identical(dp);
}

/// `path`'s checkpoint with its parameter tensors changed by `edit` (the rest kept).
void rewrite(const std::string& path, const std::string& to,
             const std::function<void(std::vector<at::Tensor>&)>& edit) {
  torch::serialize::InputArchive in;
  in.load_from(path);
  std::vector<at::Tensor> ps;
  for (at::Tensor t; in.try_read("param." + std::to_string(ps.size()), t); t = at::Tensor{})
    ps.push_back(t);
  edit(ps);
  torch::serialize::OutputArchive out;  // the parameters alone: refused before any state
  for (std::size_t i = 0; i < ps.size(); ++i) out.write("param." + std::to_string(i), ps[i]);
  out.save_to(to);
}

}  // namespace

TROUPE_REGISTER_JOB(frozen_adamw);
TROUPE_REGISTER_JOB(two_heads);

TEST(TrainState, AFrozenParameterStaysExactlyAsItWasUnderAdamWsWeightDecay) {
  // The optimizer got a zero gradient for a frozen parameter, and AdamW's weight decay moved it
  // (by 2.4e-3 in six steps here); a plain loop leaves it alone (its grad is undefined).
  troupe::config cfg;
  troupe::data_parallel<frozen_adamw> dp{{"cpu", "cpu"}, cfg, deterministic()};
  auto before = dp.parameters();
  for (auto& b : make_batches(6, 32)) dp.step(b);
  auto after = dp.parameters();
  ASSERT_EQ(after.size(), 6u);
  EXPECT_TRUE(same_bits(after[0], before[0])) << "the frozen weight moved";
  EXPECT_TRUE(same_bits(after[1], before[1])) << "the frozen bias moved";
  EXPECT_FALSE(same_bits(after[2], before[2])) << "the trained layer did not move";
  expect_identical(dp);
}

TEST(TrainState, AParameterNoShardOfAStepUsedGetsNoGradientAndStaysAsItWas) {
  // The second head is reached by one shard of the first batch (on one replica: the other's
  // shards do not reach it, and it must still take that step's update), then by none: it gets
  // no gradient, as in a plain loop, and AdamW leaves it alone. It got a zero gradient, and
  // weight decay and Adam's moments moved it at every step.
  troupe::config cfg;
  troupe::data_parallel<two_heads> dp{{"cpu", "cpu"}, cfg, deterministic(8)};
  auto bs = make_batches(4, 32);
  bs[0][3].x[0] = 1000;  // shard 0 reaches the second head
  auto before = dp.parameters();
  dp.step(bs[0]);
  expect_identical(dp);
  auto reached = dp.parameters();
  ASSERT_EQ(reached.size(), 8u);
  EXPECT_FALSE(same_bits(reached[6], before[6])) << "the reached head did not move";
  for (int i = 1; i < 4; ++i) dp.step(bs[i]);
  expect_identical(dp);
  auto after = dp.parameters();
  EXPECT_TRUE(same_bits(after[6], reached[6])) << "the head no shard used moved";
  EXPECT_TRUE(same_bits(after[7], reached[7])) << "the head's bias no shard used moved";
  EXPECT_FALSE(same_bits(after[0], reached[0])) << "the first head did not move";
}

TEST(TrainState, ALoadReplacesTheOptimizersStateItDoesNotMergeIntoIt) {
  // A rollback: Adam trained 5 steps, then the checkpoint of step 0 (no moments yet) loaded.
  // Optimizer::load overwrote only the entries the archive held: the 5 steps' moments and step
  // counts survived, and the next steps differed from a fresh run from that checkpoint.
  auto bs = make_batches(8, 32);
  auto path = testing::TempDir() + "troupe_state_rollback.pt";
  dp_t a{{"cpu", "cpu"}, cfg_with("adam"), deterministic()};
  a.save(path);
  for (int i = 0; i < 5; ++i) a.step(bs[i]);
  a.load(path);
  for (int i = 5; i < 8; ++i) a.step(bs[i]);
  dp_t b{{"cpu"}, cfg_with("adam"), deterministic()};
  b.load(path);
  for (int i = 5; i < 8; ++i) b.step(bs[i]);
  EXPECT_TRUE(same_bits(flat(a.parameters()), flat(b.parameters())));
  std::remove(path.c_str());
}

TEST(TrainState, AStepAfterALocalStepOnFewerShardsThanReplicasLeavesThemIdentical) {
  // One shard, three replicas: one of them steps alone and has Adam moments, the first has
  // none. The next step() copies the first replica's state to the others: the moments of the
  // one that stepped survived that copy, and it drifted from the others at every step after.
  auto bs = make_batches(4, 32);
  dp_t dp{{"cpu", "cpu", "cpu"}, cfg_with("adam"), deterministic(8)};
  std::vector<sample> one_shard(bs[0].begin(), bs[0].begin() + 8);
  dp.local_step(one_shard);
  dp.average_parameters();
  for (int i = 1; i < 4; ++i) {
    dp.step(bs[i]);
    expect_identical(dp);
  }
}

TEST(TrainState, TheLastReplicaRemovedKeepsTheStateForTheNextOneAdded) {
  // Moving a run to another device by removing the last replica and adding one: the new
  // replica started over from the constructor's model, silently. Now it goes on where the
  // last one left off, bit for bit.
  auto bs = make_batches(5, 32);
  dp_t ref{{"cpu"}, cfg_with("adam"), deterministic()};
  for (auto& b : bs) ref.step(b);
  dp_t dp{{"cpu"}, cfg_with("adam"), deterministic()};
  for (int i = 0; i < 3; ++i) dp.step(bs[i]);
  auto kept = flat(dp.parameters());
  dp.remove_devices({"cpu"});
  EXPECT_TRUE(dp.devices().empty());
  auto path = testing::TempDir() + "troupe_state_held.pt";
  dp.save(path);  // the state held, with no replica
  dp.add_devices({"cpu"});
  EXPECT_TRUE(same_bits(flat(dp.parameters()), kept));
  for (int i = 3; i < 5; ++i) dp.step(bs[i]);
  EXPECT_TRUE(same_bits(flat(dp.parameters()), flat(ref.parameters())));
  dp_t from_file{{"cpu"}, cfg_with("adam"), deterministic()};
  from_file.load(path);
  EXPECT_TRUE(same_bits(flat(from_file.parameters()), kept));
  std::remove(path.c_str());
}

TEST(TrainState, ReplicasAddedAfterEveryOneWasLostAreRefusedUntilACheckpointIsLoaded) {
  auto bs = make_batches(4, 32);
  auto path = testing::TempDir() + "troupe_state_lost.pt";
  troupe::config cfg;
  troupe::data_parallel<frozen_adamw> dp{{"cpu", "cpu"}, cfg, deterministic()};
  dp.step(bs[0]);
  dp.save(path);
  auto saved = flat(dp.parameters());
  steps_throw = true;
  try {
    dp.step(bs[1]);
    ADD_FAILURE() << "step() did not throw";
  } catch (const troupe::work_error& e) {
    EXPECT_NE(std::string{e.what()}.find("no replica is left"), std::string::npos) << e.what();
  }
  steps_throw = false;
  EXPECT_TRUE(dp.devices().empty());
  // The training's state went with the replicas: new ones would start from the constructor's.
  try {
    dp.add_devices({"cpu"});
    ADD_FAILURE() << "add_devices() started over from the constructors' model";
  } catch (const troupe::node_error& e) {
    EXPECT_NE(std::string{e.what()}.find("load() a checkpoint"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(dp.devices().empty());
  dp.load(path);  // with no replica: kept for the next ones
  dp.add_devices({"cpu", "cpu"});
  EXPECT_TRUE(same_bits(flat(dp.parameters()), saved));
  expect_identical(dp);
  dp.step(bs[2]);
  std::remove(path.c_str());
}

TEST(TrainState, ACheckpointOfAnotherModelOrOptimizerIsRefusedAndChangesNothing) {
  auto bs = make_batches(4, 32);
  auto dir = testing::TempDir();
  auto adam_path = dir + "troupe_state_adam.pt", sgd_path = dir + "troupe_state_sgd.pt";
  auto bad_path = dir + "troupe_state_bad.pt";
  dp_t adam{{"cpu"}, cfg_with("adam"), deterministic()};
  adam.step(bs[0]);
  adam.save(adam_path);
  dp_t sgd{{"cpu", "cpu"}, cfg_with("sgd"), deterministic()};
  sgd.step(bs[0]);
  sgd.save(sgd_path);
  dp_t ref{{"cpu"}, cfg_with("sgd"), deterministic()};
  ref.step(bs[0]);
  auto before = flat(sgd.parameters());
  auto refused = [&](const std::string& path, const char* says) {
    SCOPED_TRACE(says);
    try {
      sgd.load(path);
      ADD_FAILURE() << "loaded";
    } catch (const troupe::error& e) {
      EXPECT_NE(std::string{e.what()}.find(says), std::string::npos) << e.what();
    }
    EXPECT_EQ(sgd.devices().size(), 2u) << "a replica was dropped";
    EXPECT_TRUE(same_bits(flat(sgd.parameters()), before)) << "the parameters changed";
    expect_identical(sgd);
  };
  // Adam's state into SGD: LibTorch's own assertion ("please report a bug to PyTorch"), after
  // the parameters were replaced.
  refused(adam_path, "does not fit this replica");
  // A transposed weight: as many elements, another shape (loaded silently before).
  rewrite(sgd_path, bad_path, [](auto& ps) { ps[0] = ps[0].t().contiguous(); });
  refused(bad_path, "its tensor 0 is [8, 16]");
  // A deeper model whose first tensors match: its first four were loaded, then the optimizer's
  // state threw.
  rewrite(sgd_path, bad_path, [](auto& ps) {
    ps.push_back(torch::zeros({3, 3}));
    ps.push_back(torch::zeros({3}));
  });
  refused(bad_path, "more than the 6 parameter tensors");
  // Untouched: the next steps equal those of a run that never tried.
  for (int i = 1; i < 4; ++i) {
    sgd.step(bs[i]);
    ref.step(bs[i]);
  }
  EXPECT_TRUE(same_bits(flat(sgd.parameters()), flat(ref.parameters())));
  for (auto& p : {adam_path, sgd_path, bad_path}) std::remove(p.c_str());
}
