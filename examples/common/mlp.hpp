// The small MLP that both inference examples replicate on every device, and their check of the
// outputs against one model run on the whole input.
#pragma once

#include <torch/torch.h>

#include <iomanip>
#include <iostream>
#include <mutex>
#include <stdexcept>
#include <troupe/torch.hpp>

namespace example {

constexpr std::int64_t mlp_features = 16;

inline torch::nn::Sequential make_mlp() {
  static std::mutex rng;  // the global RNG: replicas built concurrently must not interleave
  std::lock_guard<std::mutex> guard{rng};
  torch::manual_seed(7);  // every replica gets the same weights
  return torch::nn::Sequential(torch::nn::Linear(mlp_features, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 4));
}

/// One replica of the MLP on a producer's device, in eval mode.
struct mlp_replica {
  explicit mlp_replica(const troupe::device& d) : where(d), model(make_mlp()) {
    model->to(troupe::torch_device(d));
    model->eval();
  }
  /// Runs a [rows, features] host tensor on the device; the output stays there.
  at::Tensor forward(const at::Tensor& x) {
    torch::NoGradGuard no_grad;
    return model->forward(troupe::to_device(x, where));
  }
  troupe::device where;
  torch::nn::Sequential model;
};

/// Throws unless `outputs` equal one MLP applied to all of `inputs`; prints the result line.
inline void check_and_report(const at::Tensor& outputs, const at::Tensor& inputs) {
  torch::NoGradGuard no_grad;
  if (!torch::allclose(outputs, make_mlp()->forward(inputs), 1e-4, 1e-5))
    throw std::runtime_error("outputs differ from the single-model reference");
  std::cout << "rows: " << outputs.size(0) << ", matches the single-model reference\n";
  std::cout << std::fixed << std::setprecision(4) << "result: " << outputs.sum().item<double>()
            << "\n";
}

}  // namespace example
