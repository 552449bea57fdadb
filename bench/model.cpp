// A model exported from Python over images on CPU producers (BENCHMARKS.md, "Real models on CPU
// producers"): examples/export_model.py's ResNet-style CNN (.pt: TorchScript, .pt2: AOTInductor)
// loaded once per device (device_state) and shared by --producers CPU producers, each with its
// own LibTorch intra-op thread budget: the default (the cores divided among the producers) and
// each hand-set count of --threads (cfg torch.intra_op_threads). Against the loop a LibTorch user
// writes, with all of LibTorch's threads, in the same process, over the same items:
//
//   c10::InferenceMode guard;
//   for (auto& x : items) outputs.push_back(module.forward({x}).toTensor());
//
// Items of --per-item images each; every configuration's outputs equal the loop's (checked);
// images/s, the best of --repeat runs after a warm-up run.
//
//   python examples/export_model.py m.pt --channels 3 --side 32 --width 32 --blocks 4
//   troupe_model_bench --model m.pt --inputs 3072 --images 512 --per-item 1 --threads 1 2
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <troupe/torch.hpp>
#include <troupe/troupe.hpp>

#include "bench_report.hpp"

namespace {

using bench::clock_type;
using bench::seconds_since;

/// The model in `file` (.pt or .pt2) on the CPU, as a function of a batch.
std::function<at::Tensor(const at::Tensor&)> load(const std::string& file) {
  if (file.size() > 4 && file.compare(file.size() - 4, 4, ".pt2") == 0) {
    auto loader = std::make_shared<torch::inductor::AOTIModelPackageLoader>(file);
    return [loader](const at::Tensor& x) { return loader->run({x}).at(0); };
  }
  auto module = std::make_shared<torch::jit::Module>(torch::jit::load(file));
  module->eval();
  return [module](const at::Tensor& x) { return module->forward({x}).toTensor(); };
}

}  // namespace

/// Images in, class scores out: the model is the device's state, shared by its producers.
struct classify_images {
  struct device_state {
    device_state(const troupe::device&, const troupe::config& cfg)
        : model(load(cfg.get<std::string>("model_file"))) {}
    std::function<at::Tensor(const at::Tensor&)> model;
  };
  struct producer {
    producer(const troupe::device&, const troupe::config& cfg, device_state& shared)
        : model(shared), inputs(cfg.get<std::int64_t>("inputs")) {}
    void warmup() {
      c10::InferenceMode guard;
      for (int i = 0; i < 3; ++i) model.model(torch::zeros({1, inputs}));
    }
    at::Tensor work(const at::Tensor& x) {
      c10::InferenceMode guard;
      return model.model(x);
    }
    device_state& model;
    std::int64_t inputs;
  };
};

TROUPE_REGISTER_JOB(classify_images);

int main(int argc, char** argv) {
  CLI::App app{
      "troupe_model_bench: a model exported from Python over images, troupe's CPU "
      "producers against the LibTorch loop"};
  std::string file;
  std::int64_t inputs = 3072, per_item = 1;
  std::size_t images = 512, producers = 2;
  std::vector<int> threads;
  int repeat = 3;
  app.add_option("--model", file, "a .pt or .pt2 from examples/export_model.py")->required();
  app.add_option("--inputs", inputs, "numbers per image (channels x side x side)");
  app.add_option("--images", images);
  app.add_option("--per-item", per_item, "images per item (one forward pass each)");
  app.add_option("--producers", producers, "CPU producers");
  app.add_option("--threads", threads,
                 "hand-set intra-op threads per producer to compare (after the default); "
                 "a list with 0 in it runs exactly that list, 0 being the default budget "
                 "(e.g. 1 0 1 0 alternates, so that order effects show)");
  app.add_option("--repeat", repeat, "runs of each configuration; the best is reported");
  CLI11_PARSE(app, argc, argv);
  if (file.size() > 4 && file.compare(file.size() - 4, 4, ".pt2") == 0)
    ::setenv("AOTI_RUNTIME_CHECK_INPUTS", "1", 0);

  torch::manual_seed(1);
  std::vector<at::Tensor> items;
  for (std::size_t i = 0; i < images / static_cast<std::size_t>(per_item); ++i)
    items.push_back(torch::randn({per_item, inputs}));
  auto n_images = static_cast<double>(items.size() * static_cast<std::size_t>(per_item));

  auto model = load(file);
  std::vector<at::Tensor> expected;
  double loop_best = 1e30;
  for (int r = 0; r <= repeat; ++r) {  // run 0 warms up
    std::vector<at::Tensor> out;
    auto t = clock_type::now();
    {
      c10::InferenceMode guard;
      for (auto& x : items) out.push_back(model(x));
    }
    if (r > 0) loop_best = std::min(loop_best, seconds_since(t));
    expected = std::move(out);
  }
  std::printf("%s: %zu images, %lld per item, %zu CPU producers\n", file.c_str(), items.size(),
              static_cast<long long>(per_item), producers);
  std::printf("%-44s %10.1f images/s\n",
              ("LibTorch loop, " + std::to_string(at::get_num_threads()) + " threads").c_str(),
              n_images / loop_best);

  troupe::config cfg;
  cfg.set("model_file", file);
  cfg.set("inputs", inputs);
  std::vector<int> settings{0};
  if (std::find(threads.begin(), threads.end(), 0) != threads.end()) settings.clear();
  settings.insert(settings.end(), threads.begin(), threads.end());
  for (int t : settings) {
    auto c = cfg;
    if (t > 0) c.set("torch.intra_op_threads", std::int64_t{t});
    troupe::ordered_runner<classify_images> runner{troupe::cpus(producers), c};
    double best = 1e30;
    for (int r = 0; r <= repeat; ++r) {
      auto start = clock_type::now();
      auto out = runner.run(items);
      if (r > 0) best = std::min(best, seconds_since(start));
      for (std::size_t i = 0; i < out.size(); ++i)
        if (!torch::allclose(out[i], expected[i], 1e-4, 1e-4))
          throw std::runtime_error("item " + std::to_string(i) + " differs from the loop's");
    }
    std::printf("%-44s %10.1f images/s\n",
                ("troupe, " + (t > 0 ? std::to_string(t) + " thread(s) per producer (hand-set)"
                                     : std::string{"default thread budget"}))
                    .c_str(),
                n_images / best);
  }
  return 0;
}
