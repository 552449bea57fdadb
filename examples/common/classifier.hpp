// The `train` example's job (also used by the training tests): an MLP classifier trained with
// SGD + momentum (or Adam, AdamW), and the labelled data it learns, generated from a seed.
#pragma once

#include <torch/torch.h>

#include <caf/meta/type_name.hpp>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <thread>
#include <troupe/torch.hpp>
#include <troupe/train.hpp>
#include <vector>

namespace example {

/// One labelled point.
struct sample {
  std::vector<float> x;
  std::int64_t label = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sample& s) {
  return f(caf::meta::type_name("example.sample"), s.x, s.label);
}

/// Points around one random centre per class: `classes` classes, `features` features.
struct dataset {
  std::vector<sample> train, test;
};

inline dataset make_data(std::size_t n_train, std::size_t n_test, std::size_t classes,
                         std::size_t features, std::uint64_t seed) {
  std::mt19937_64 rng{seed};
  std::normal_distribution<float> normal{0.0f, 1.0f};
  std::vector<std::vector<float>> centres(classes, std::vector<float>(features));
  for (auto& c : centres)
    for (auto& v : c) v = 1.2f * normal(rng);
  auto draw = [&](std::size_t n) {
    std::vector<sample> out(n);
    std::uniform_int_distribution<std::size_t> pick{0, classes - 1};
    for (auto& s : out) {
      auto y = pick(rng);
      s.label = static_cast<std::int64_t>(y);
      s.x.resize(features);
      for (std::size_t j = 0; j < features; ++j) s.x[j] = centres[y][j] + 1.5f * normal(rng);
    }
    return out;
  };
  return {draw(n_train), draw(n_test)};
}

/// This process serves replicas as a node (the --serve flag): the fault-injection key below only
/// acts there.
inline bool& serving() {
  static bool flag = false;
  return flag;
}

/// Two hidden layers with ReLU; `classes` logits.
struct mlp_net : torch::nn::Module {
  mlp_net(std::int64_t in, std::int64_t hidden, std::int64_t classes)
      : l1(register_module("l1", torch::nn::Linear(in, hidden))),
        l2(register_module("l2", torch::nn::Linear(hidden, hidden))),
        l3(register_module("l3", torch::nn::Linear(hidden, classes))) {}
  torch::Tensor forward(torch::Tensor x) { return l3(torch::relu(l2(torch::relu(l1(x))))); }
  torch::nn::Linear l1, l2, l3;
};

/// The samples of `shard` as a feature matrix and a label vector.
inline std::pair<torch::Tensor, torch::Tensor> stack(const std::vector<sample>& shard,
                                                     std::int64_t features) {
  auto x = torch::empty({static_cast<std::int64_t>(shard.size()), features});
  auto y = torch::empty({static_cast<std::int64_t>(shard.size())}, torch::kLong);
  auto* xp = x.data_ptr<float>();
  auto* yp = y.data_ptr<std::int64_t>();
  for (std::size_t i = 0; i < shard.size(); ++i) {
    if (static_cast<std::int64_t>(shard[i].x.size()) != features)
      throw std::invalid_argument("a sample with " + std::to_string(shard[i].x.size()) +
                                  " features, the model takes " + std::to_string(features));
    if (shard[i].label < 0) throw std::invalid_argument("a sample with a negative label");
    std::copy(shard[i].x.begin(), shard[i].x.end(), xp + i * features);
    yp[i] = shard[i].label;
  }
  return {x, y};
}

/// The model's parameters drawn from `seed` with a generator of their own (LibTorch's default
/// generator is shared by every thread of the process).
inline void init_parameters(torch::nn::Module& m, std::uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) {
    auto bound = 1.0 / std::sqrt(static_cast<double>(p.dim() > 1 ? p.size(1) : p.size(0)));
    auto v = torch::empty(p.sizes()).uniform_(-bound, bound, gen);
    p.copy_(v);
  }
}

/// The optimizer `cfg` names: optim ("sgd", the default, with sgd.momentum; "adam"; "adamw")
/// at learning rate sgd.lr.
inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(
    const std::vector<torch::Tensor>& params, const troupe::config& cfg) {
  auto kind = cfg.get_or<std::string>("optim", "sgd");
  auto lr = cfg.get_or<double>("sgd.lr", 0.05);
  if (kind == "adam")
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(lr));
  if (kind == "adamw")
    return std::make_unique<torch::optim::AdamW>(params,
                                                 torch::optim::AdamWOptions(lr).weight_decay(0.01));
  if (kind != "sgd") throw std::invalid_argument("optim: sgd, adam or adamw, not " + kind);
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(lr).momentum(cfg.get_or<double>("sgd.momentum", 0.9)));
}

/// The job: config keys model.features, model.hidden, model.classes, model.seed, model.init
/// ("own", the default: parameters drawn from a generator of their own; "torch": the way PyTorch
/// scripts do it, torch::manual_seed(model.seed) and LibTorch's default initialisation), optim,
/// sgd.lr, sgd.momentum; fault.exit_at_shard (a node's replica kills its own process with SIGKILL
/// at that shard, counting from 1: to test recovery), fault.sleep_ms (per shard: a slow device) and
/// fault.local_sleep_ms (per shard, only for replicas in the calling process, not on nodes).
struct classifier {
  struct replica {
    replica(const troupe::device& d, const troupe::config& cfg)
        : features(cfg.get_or<std::int64_t>("model.features", 32)),
          where(troupe::torch_device(d)),
          exit_at(cfg.get_or<std::int64_t>("fault.exit_at_shard", 0)),
          sleep_ms(cfg.get_or<std::int64_t>("fault.sleep_ms", 0)),
          local_sleep_ms(cfg.get_or<std::int64_t>("fault.local_sleep_ms", 0)) {
      auto seed = static_cast<std::uint64_t>(cfg.get_or<std::int64_t>("model.seed", 7));
      bool global = cfg.get_or<std::string>("model.init", "own") == "torch";
      if (global) torch::manual_seed(seed);
      net = std::make_shared<mlp_net>(features, cfg.get_or<std::int64_t>("model.hidden", 64),
                                      cfg.get_or<std::int64_t>("model.classes", 4));
      if (!global) init_parameters(*net, seed);
      net->to(where);
      opt = make_optimizer(net->parameters(), cfg);  // on the parameters' device
    }
    std::vector<torch::Tensor> parameters() { return net->parameters(); }
    double backward(const std::vector<sample>& shard) {
      if (serving() && exit_at > 0 && ++shards_seen == exit_at) std::raise(SIGKILL);
      if (sleep_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds{sleep_ms});
      if (!serving() && local_sleep_ms > 0)
        std::this_thread::sleep_for(std::chrono::milliseconds{local_sleep_ms});
      auto [x, y] = stack(shard, features);
      auto loss = torch::nn::functional::cross_entropy(
          net->forward(x.to(where)), y.to(where),
          torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
      loss.backward();
      return loss.item<double>();
    }
    void step() { opt->step(); }
    /// troupe saves and loads its state (momentum, Adam's moments) wherever the parameters
    /// travel: a node that joins, add_devices, dp.save/load.
    torch::optim::Optimizer& optimizer() { return *opt; }

    std::int64_t features;
    std::shared_ptr<mlp_net> net;
    torch::Device where;
    std::unique_ptr<torch::optim::Optimizer> opt;
    std::int64_t exit_at, sleep_ms, local_sleep_ms;
    std::int64_t shards_seen = 0;
  };
};

/// Share of `data` the parameters classify correctly.
inline double accuracy(const std::vector<torch::Tensor>& params, const std::vector<sample>& data,
                       const troupe::config& cfg) {
  auto features = cfg.get_or<std::int64_t>("model.features", 32);
  mlp_net net(features, cfg.get_or<std::int64_t>("model.hidden", 64),
              cfg.get_or<std::int64_t>("model.classes", 4));
  {
    torch::NoGradGuard no_grad;
    auto mine = net.parameters();
    for (std::size_t i = 0; i < mine.size(); ++i) mine[i].copy_(params.at(i));
  }
  auto [x, y] = stack(data, features);
  auto predicted = net.forward(x).argmax(1);
  return predicted.eq(y).to(torch::kDouble).mean().item<double>();
}

/// FNV-1a of the parameters' bytes, as 16 hex digits.
inline std::string params_hash(const std::vector<torch::Tensor>& params) {
  std::uint64_t h = 1469598103934665603ull;
  for (auto& p : params) {
    auto c = p.contiguous().cpu();
    auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
    for (std::size_t i = 0; i < c.nbytes(); ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  }
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h));
  return out;
}

}  // namespace example
