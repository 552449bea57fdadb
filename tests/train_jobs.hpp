// A training job that the training tests and the test node (troupe_test_node, with LibTorch)
// both register: replicas written the way PyTorch scripts write them, whose optimizer's state
// cannot travel (neither optimizer() nor save/load).
#pragma once

#include <torch/torch.h>

#include <memory>
#include <troupe/troupe.hpp>
#include <vector>

#include "common/classifier.hpp"

/// `n` batches of `size` samples of the 8-feature, 3-class data set drawn from `seed`.
inline std::vector<std::vector<example::sample>> make_batches(std::size_t n, std::size_t size,
                                                              std::uint64_t seed = 11) {
  auto data = example::make_data(n * size, 0, 3, 8, seed);
  std::vector<std::vector<example::sample>> out(n);
  for (std::size_t i = 0; i < n * size; ++i) out[i / size].push_back(data.train[i]);
  return out;
}

/// The shard's summed cross-entropy loss through `net` (8 features), back-propagated: its value.
template <class Net>
double summed_loss_backward(Net& net, const std::vector<example::sample>& shard) {
  auto [x, y] = example::stack(shard, 8);
  auto loss = torch::nn::functional::cross_entropy(
      net->forward(x), y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  loss.backward();
  return loss.template item<double>();
}

/// A replica written the way PyTorch scripts write one: the constructor seeds torch's global
/// generator and builds the model from it (no generator of its own), SGD with momentum.
struct seeded_classifier {
  struct replica {
    replica(const troupe::device&, const troupe::config& cfg) {
      torch::manual_seed(static_cast<std::uint64_t>(cfg.get_or<std::int64_t>("model.seed", 3)));
      net = torch::nn::Sequential(torch::nn::Linear(8, 256), torch::nn::ReLU(),
                                  torch::nn::Linear(256, 256), torch::nn::ReLU(),
                                  torch::nn::Linear(256, 3));
      opt = std::make_unique<torch::optim::SGD>(net->parameters(),
                                                torch::optim::SGDOptions(0.05).momentum(0.9));
    }
    std::vector<torch::Tensor> parameters() { return net->parameters(); }
    double backward(const std::vector<example::sample>& shard) {
      return summed_loss_backward(net, shard);
    }
    void step() { opt->step(); }
    torch::nn::Sequential net{nullptr};
    std::unique_ptr<torch::optim::SGD> opt;
  };
};
