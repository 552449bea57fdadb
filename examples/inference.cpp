// inference: a torch::nn MLP replicated on every device; rows streamed one at a time,
// outputs concatenated in input order (seed example 2).
//
//   row i ──▶ producer: model(row) on its device ──▶ consumer: cat in order ──▶ checksum
#include <torch/torch.h>

#include <iomanip>
#include <iostream>
#include <mutex>
#include <troupe/torch.hpp>

#include "common/cli.hpp"

torch::nn::Sequential make_model(std::int64_t features) {
  static std::mutex rng;  // the global RNG: replicas built concurrently must not interleave
  std::lock_guard<std::mutex> guard{rng};
  torch::manual_seed(7);  // every replica gets the same weights
  return torch::nn::Sequential(torch::nn::Linear(features, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 4));
}

struct inference {
  struct producer {
    producer(const troupe::device& d, const troupe::config& cfg)
        : where(d), model(make_model(cfg.get<std::int64_t>("features"))) {
      at::set_num_threads(1);  // several producers share the cores
      model->to(troupe::torch_device(d));
      model->eval();
    }
    at::Tensor work(const at::Tensor& row) {
      torch::NoGradGuard no_grad;
      return model->forward(troupe::to_device(row, where).unsqueeze(0)).squeeze(0);
    }
    troupe::device where;
    torch::nn::Sequential model;
  };
  struct consumer {
    void work(at::Tensor y) { rows.push_back(troupe::to_host(y)); }
    at::Tensor end() { return rows.empty() ? torch::empty({0, 4}) : torch::stack(rows); }
    std::vector<at::Tensor> rows;
  };
};

int main(int argc, char** argv) {
  CLI::App app{"inference: an MLP on every device, rows streamed one at a time"};
  example::flags f;
  f.ordered = true;
  example::add_flags(app, f);
  CLI11_PARSE(app, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;
  return example::guarded([&] {
    const std::int64_t features = 16;
    troupe::config cfg;
    cfg.set("features", features);
    torch::manual_seed(1);
    auto inputs = torch::randn({static_cast<std::int64_t>(f.items), features});
    std::vector<at::Tensor> rows = inputs.unbind(0);
    troupe::ordered_runner<inference> runner{f.device_list(), cfg};
    auto outputs = runner.run(rows);
    torch::NoGradGuard no_grad;
    auto expected = make_model(features)->forward(inputs);  // one model, whole batch
    if (!torch::allclose(outputs, expected, 1e-4, 1e-5))
      throw std::runtime_error("outputs differ from the single-model reference");
    std::cout << "rows: " << outputs.size(0) << ", matches the single-model reference\n";
    std::cout << std::fixed << std::setprecision(4) << "result: " << outputs.sum().item<double>()
              << "\n";
  });
}
