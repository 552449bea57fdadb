// batched_inference: the inference example over batches pulled from a generator (seed
// example 3). The generator makes each batch only when a producer has room for it.
//
//   generate(batch) ──▶ producer: model(batch) ──▶ consumer: cat in order ──▶ checksum
#include <torch/torch.h>

#include <iomanip>
#include <iostream>
#include <mutex>
#include <troupe/torch.hpp>

#include "common/cli.hpp"

torch::nn::Sequential make_model(std::int64_t features) {
  static std::mutex rng;  // the global RNG: replicas built concurrently must not interleave
  std::lock_guard<std::mutex> guard{rng};
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(features, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 4));
}

struct batched_inference {
  struct producer {
    producer(const troupe::device& d, const troupe::config& cfg)
        : where(d), model(make_model(cfg.get<std::int64_t>("features"))) {
      at::set_num_threads(1);
      model->to(troupe::torch_device(d));
      model->eval();
    }
    at::Tensor work(const at::Tensor& batch) {
      torch::NoGradGuard no_grad;
      return model->forward(troupe::to_device(batch, where));
    }
    troupe::device where;
    torch::nn::Sequential model;
  };
  struct consumer {
    void work(at::Tensor y) { parts.push_back(troupe::to_host(y)); }
    at::Tensor end() { return parts.empty() ? torch::empty({0, 4}) : torch::cat(parts); }
    std::vector<at::Tensor> parts;
  };
};

int main(int argc, char** argv) {
  CLI::App app{"batched_inference: an MLP on every device over generated batches"};
  example::flags f;
  f.ordered = true;
  std::int64_t batch = 32;
  example::add_flags(app, f);
  app.add_option("--batch", batch, "rows per batch");
  CLI11_PARSE(app, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;
  return example::guarded([&] {
    const std::int64_t features = 16, rows = static_cast<std::int64_t>(f.items);
    troupe::config cfg;
    cfg.set("features", features);
    torch::manual_seed(1);
    auto inputs = torch::randn({rows, features});
    std::int64_t next = 0;
    troupe::ordered_runner<batched_inference> runner{f.device_list(), cfg};
    auto outputs = runner.run(troupe::generate([&]() -> std::optional<at::Tensor> {
      if (next >= rows) return std::nullopt;
      auto b = inputs.slice(0, next, std::min(next + batch, rows));
      next += batch;
      return b;
    }));
    torch::NoGradGuard no_grad;
    if (!torch::allclose(outputs, make_model(features)->forward(inputs), 1e-4, 1e-5))
      throw std::runtime_error("outputs differ from the single-model reference");
    std::cout << "rows: " << outputs.size(0) << ", matches the single-model reference\n";
    std::cout << std::fixed << std::setprecision(4) << "result: " << outputs.sum().item<double>()
              << "\n";
  });
}
