// Inference on devices (BENCHMARKS.md, "Inference on a GPU"): an MLP over batches of rows.
// troupe's ordered_runner with one producer per --devices entry (each with its own CUDA stream
// on a GPU) against the loop a LibTorch user writes for one device, in the same process, on the
// same model and the same batches:
//
//   c10::InferenceMode guard;
//   for (auto& x : batches) outputs.push_back(model->forward(x.to(device)).to(torch::kCPU));
//
// and the same loop with its inputs pinned ahead and copied non_blocking (what a DataLoader with
// pin_memory=True gives). Every configuration checks that its outputs equal the loop's, then
// reports batches/s and rows/s, the best of --repeat runs, and its share of the faster loop's.
//
//   troupe_inference_bench --devices cuda:0 cuda:0,cuda:0 --batches 400 --rows 256 --width 2048
//   troupe_inference_bench --devices cpu cpu,cpu --batches 40 --rows 64 --width 256   (no GPU)
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <troupe/torch.hpp>
#include <troupe/troupe.hpp>

#include "bench_report.hpp"

namespace {

using bench::clock_type;
using bench::seconds_since;

/// The model: `layers` Linear+ReLU of `width`, then a Linear to 16 outputs; the same weights
/// wherever it is built (its own generator, seeded).
torch::nn::Sequential make_model(std::int64_t width, std::int64_t layers) {
  static std::mutex rng;  // the global RNG: replicas built concurrently must not interleave
  std::lock_guard<std::mutex> guard{rng};
  torch::manual_seed(11);
  torch::nn::Sequential m;
  for (std::int64_t i = 0; i < layers; ++i) {
    m->push_back(torch::nn::Linear(width, width));
    m->push_back(torch::nn::ReLU());
  }
  m->push_back(torch::nn::Linear(width, 16));
  m->eval();
  return m;
}

struct mlp_inference {
  struct producer {
    producer(const troupe::device& d, const troupe::config& cfg)
        : where(d),
          model(make_model(cfg.get_or<std::int64_t>("width", 256),
                           cfg.get_or<std::int64_t>("layers", 4))) {
      if (d.is_cpu()) at::set_num_threads(1);  // CPU producers share the cores
      model->to(troupe::torch_device(d));
    }
    /// A host batch in, a host batch out: what a caller of an inference service gets back.
    at::Tensor work(const at::Tensor& x) {
      c10::InferenceMode guard;
      return troupe::to_host(model->forward(troupe::to_device(x, where)));
    }
    troupe::device where;
    torch::nn::Sequential model;
  };
};

std::vector<troupe::device> parse_devices(const std::string& list) {
  std::vector<troupe::device> out;
  std::stringstream in(list);
  for (std::string spec; std::getline(in, spec, ',');) out.emplace_back(spec);
  return out;
}

void report(const char* what, const std::string& devices, double best_s, std::size_t batches,
            std::int64_t rows, double baseline_s) {
  std::printf("%-34s %-22s %10.1f batches/s %12.0f rows/s %7.1f %%\n", what, devices.c_str(),
              static_cast<double>(batches) / best_s,
              static_cast<double>(batches) * static_cast<double>(rows) / best_s,
              100.0 * baseline_s / best_s);
}

}  // namespace

TROUPE_REGISTER_JOB(mlp_inference);

int main(int argc, char** argv) {
  CLI::App app{"troupe_inference_bench: an MLP over batches, troupe against a LibTorch loop"};
  std::vector<std::string> device_lists{"cpu", "cpu,cpu"};
  std::size_t batches = 40;
  std::int64_t rows = 64, width = 256, layers = 4;
  int repeat = 3;
  app.add_option("--devices", device_lists, "device lists to run troupe on (each a,b,...)");
  app.add_option("--batches", batches);
  app.add_option("--rows", rows, "rows per batch");
  app.add_option("--width", width, "features and hidden width");
  app.add_option("--layers", layers, "hidden layers");
  app.add_option("--repeat", repeat, "runs of each configuration; the best is reported");
  CLI11_PARSE(app, argc, argv);

  auto first = parse_devices(device_lists.at(0)).at(0);
  if (auto why = troupe::why_unavailable(first); !why.empty()) {
    std::printf("skipped: %s\n", why.c_str());
    return 0;
  }
  torch::manual_seed(1);
  std::vector<at::Tensor> inputs;
  for (std::size_t i = 0; i < batches; ++i) inputs.push_back(torch::randn({rows, width}));

  // The LibTorch loop on the first device of the first list, as written with plain tensors and
  // as written with a DataLoader's pin_memory=True (inputs pinned ahead, copies non_blocking).
  auto model = make_model(width, layers);
  auto dev = troupe::torch_device(first);
  model->to(dev);
  std::vector<at::Tensor> expected;
  auto time_loop = [&](const std::vector<at::Tensor>& xs, bool non_blocking) {
    double best = 1e30;
    for (int r = 0; r <= repeat; ++r) {  // run 0 warms up (allocator, kernels)
      std::vector<at::Tensor> out;
      auto t = clock_type::now();
      {
        c10::InferenceMode guard;
        for (auto& x : xs) out.push_back(model->forward(x.to(dev, non_blocking)).to(torch::kCPU));
      }
      if (r > 0) best = std::min(best, seconds_since(t));
      expected = std::move(out);
    }
    return best;
  };
  double loop_best = time_loop(inputs, false);
  double pinned_best = 1e30;
  std::vector<at::Tensor> pinned;
  if (first.is_cuda()) {
    for (auto& x : inputs) pinned.push_back(x.pin_memory());
    pinned_best = time_loop(pinned, true);
  }
  double baseline = std::min(loop_best, pinned_best);  // the stronger of the two
  std::printf("%zu batches of %lld rows, width %lld, %lld hidden layers\n", batches,
              static_cast<long long>(rows), static_cast<long long>(width),
              static_cast<long long>(layers));
  std::printf("%-34s %-22s %10s %19s %9s\n", "configuration", "devices", "", "", "of best loop");
  report("LibTorch loop (inference mode)", first.str(), loop_best, batches, rows, baseline);
  if (first.is_cuda())
    report("LibTorch loop, pinned, non_blocking", first.str(), pinned_best, batches, rows,
           baseline);

  troupe::config cfg;
  cfg.set("width", width).set("layers", layers);
  // troupe on the same inputs, and on the pinned ones (its producers then skip their own copy
  // into pinned memory).
  auto time_troupe = [&](troupe::ordered_runner<mlp_inference>& runner,
                         const std::vector<at::Tensor>& xs) {
    double best = 1e30;
    for (int r = 0; r <= repeat; ++r) {
      auto t = clock_type::now();
      auto out = runner.run(xs);
      if (r > 0) best = std::min(best, seconds_since(t));
      if (out.size() != expected.size())
        throw std::runtime_error(std::to_string(out.size()) + " outputs for " +
                                 std::to_string(expected.size()) + " batches");
      for (std::size_t i = 0; i < out.size(); ++i)
        if (!torch::allclose(out[i], expected[i], 1e-4, 1e-4))
          throw std::runtime_error("batch " + std::to_string(i) + " differs from the loop's");
    }
    return best;
  };
  for (const auto& list : device_lists) {
    troupe::ordered_runner<mlp_inference> runner{parse_devices(list), cfg};
    report("troupe ordered_runner", list, time_troupe(runner, inputs), batches, rows, baseline);
    if (!pinned.empty())
      report("troupe ordered_runner, pinned", list, time_troupe(runner, pinned), batches, rows,
             baseline);
  }
  return 0;
}
