// serve's models (examples/serve.cpp): the plain linear classifier, and with LibTorch the MLP
// and the models from a file (.pt, .pt2) with their checks. Private to serve.cpp, which includes
// it once.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <troupe/troupe.hpp>
#include <vector>
#ifdef TROUPE_EXAMPLES_TORCH
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <mutex>
#include <troupe/torch.hpp>
#endif

#include "common/cli.hpp"

namespace {

constexpr std::size_t n_features = 16, n_classes = 10;
/// The most numbers a request may hold when the model, not the server, says what fits.
constexpr std::size_t max_width = 65536;

/// A request the model refused (a wrong shape, say): the producers throw it with the model's
/// own message; the server answers 400 with that message, not 500.
constexpr const char* bad_input = "the model refused the input: ";

/// The last line of an error's text that says something: a TorchScript exception carries the
/// script's traceback first, then the model's own words ("builtins.ValueError: ...").
inline std::string last_line(const std::string& what) {
  auto end = what.find_last_not_of(" \n");
  if (end == std::string::npos) return what;
  auto from = what.rfind('\n', end);
  from = from == std::string::npos ? 0 : from + 1;
  return what.substr(from, end + 1 - from);
}

/// The model's weights: the same in every producer and in the self-test's check.
std::vector<float> weights() {
  std::mt19937 rng{42};
  std::normal_distribution<float> normal{0.0f, 1.0f};
  std::vector<float> w(n_features * n_classes);
  for (auto& x : w) x = normal(rng);
  return w;
}

struct prediction {
  std::int64_t label = 0;
  float score = 0;
};

prediction predict(const std::vector<float>& w, const std::vector<float>& x) {
  prediction best{0, -1e30f};
  for (std::size_t c = 0; c < n_classes; ++c) {
    float s = 0;
    for (std::size_t f = 0; f < n_features; ++f) s += w[c * n_features + f] * x[f];
    if (s > best.score) best = {static_cast<std::int64_t>(c), s};
  }
  return best;
}

}  // namespace

/// One call for a batch of requests (of any callers): what a GPU model does per forward pass.
struct classify {
  static constexpr std::size_t width = n_features;  ///< numbers per request
  struct producer {
    producer(const troupe::device&, const troupe::config& cfg)
        : w(weights()),
          call_us(cfg.get_or<std::int64_t>("call_us", 0)),
          item_us(cfg.get_or<std::int64_t>("item_us", 0)) {}
    std::vector<prediction> work(troupe::span<const std::vector<float>> rows) {
      calls += 1;
      rows_seen += rows.size();
      example::simulate_work(
          static_cast<double>(call_us + item_us * static_cast<std::int64_t>(rows.size())) / 1000.0);
      std::vector<prediction> out;
      out.reserve(rows.size());
      for (auto& x : rows) {
        if (x.size() != n_features) throw std::invalid_argument("expected 16 features");
        out.push_back(predict(w, x));
      }
      return out;
    }
    std::vector<float> w;
    std::int64_t call_us, item_us;
    static inline std::atomic<std::uint64_t> calls{0}, rows_seen{0};
  };
};

#ifdef TROUPE_EXAMPLES_TORCH
namespace {

/// The MLP: the same weights in every producer and in the self-test's check.
torch::nn::Sequential make_mlp(std::int64_t hidden, std::int64_t layers) {
  static std::mutex rng;  // torch's global generator: producers are built on threads of their own
  std::lock_guard<std::mutex> guard{rng};
  torch::manual_seed(42);
  torch::nn::Sequential m{torch::nn::Linear(static_cast<std::int64_t>(n_features), hidden),
                          torch::nn::ReLU()};
  for (std::int64_t i = 1; i < layers; ++i) {
    m->push_back(torch::nn::Linear(hidden, hidden));
    m->push_back(torch::nn::ReLU());
  }
  m->push_back(torch::nn::Linear(hidden, static_cast<std::int64_t>(n_classes)));
  return m;
}

/// Requests as one [rows, width] host tensor.
at::Tensor stack(troupe::span<const std::vector<float>> rows, std::size_t width = n_features) {
  auto x = torch::empty({static_cast<std::int64_t>(rows.size()), static_cast<std::int64_t>(width)});
  auto* p = x.data_ptr<float>();
  for (auto& r : rows) {
    if (r.size() != width)
      throw std::invalid_argument("expected " + std::to_string(width) + " numbers per request");
    p = std::copy(r.begin(), r.end(), p);
  }
  return x;
}

/// Each row's best class and its score, from a [rows, classes] tensor on any device.
std::vector<prediction> best_classes(const at::Tensor& scores) {
  auto best = scores.max(1);
  auto score = troupe::to_host(std::get<0>(best)), label = troupe::to_host(std::get<1>(best));
  std::vector<prediction> out(static_cast<std::size_t>(scores.size(0)));
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = {label[static_cast<std::int64_t>(i)].item<std::int64_t>(),
              score[static_cast<std::int64_t>(i)].item<float>()};
  return out;
}

}  // namespace

/// The same service with a LibTorch MLP: one forward pass on the producer's device per batch.
struct classify_mlp {
  static constexpr std::size_t width = n_features;
  struct producer {
    producer(const troupe::device& d, const troupe::config& cfg)
        : where(d),
          model(make_mlp(cfg.get_or<std::int64_t>("hidden", 256),
                         cfg.get_or<std::int64_t>("layers", 2))),
          call_us(cfg.get_or<std::int64_t>("call_us", 0)),
          item_us(cfg.get_or<std::int64_t>("item_us", 0)) {
      // No at::set_num_threads here: it is process-wide. Each CPU producer has an intra-op
      // budget of its own already (the cores divided among them; cfg torch.intra_op_threads).
      model->to(troupe::torch_device(d));
      model->eval();
    }
    std::vector<prediction> work(troupe::span<const std::vector<float>> rows) {
      classify::producer::calls += 1;
      classify::producer::rows_seen += rows.size();
      example::simulate_work(
          static_cast<double>(call_us + item_us * static_cast<std::int64_t>(rows.size())) / 1000.0);
      c10::InferenceMode inference;
      return best_classes(model->forward(troupe::to_device(stack(rows), where)));
    }
    troupe::device where;
    torch::nn::Sequential model;
    std::int64_t call_us, item_us;
  };
};

/// A producer of a model from a file (TorchScript or AOTInductor): `State` is the device's one
/// loaded copy (device_state, with forward()). Each producer warms it up once before its first
/// request, and a batch of requests is one forward pass. On a GPU the warm-up runs every batch
/// size the batcher can hand it (1 to cfg "max_batch"): the costs of a first call come per
/// shape, not once (cuDNN picks and builds a convolution's plan for each new input shape; on an
/// H200, 2,000 requests in batches of 1 to 64 after a warm-up of batch 4 alone ran 9.2 ms per
/// forward pass against 0.9 ms for batches of 1). On a CPU, where a forward pass costs far more
/// than a shape's first-call setup, the powers of two and the largest size (about two full
/// batches of work). A package refuses sizes past the one it was exported for: the warm-up
/// stops there.
namespace {
at::Tensor class_scores(const at::Tensor& y, std::int64_t rows, const std::string& model_file);
}  // namespace

template <class State>
struct file_model_producer {
  file_model_producer(const troupe::device& d, const troupe::config& cfg, State& shared)
      : where(d),
        model(shared),
        inputs(cfg.get_or<std::int64_t>("inputs", n_features)),
        max_batch(std::max<std::int64_t>(1, cfg.get_or<std::int64_t>("max_batch", 1))),
        file(cfg.get_or<std::string>("model_name",
                                     cfg.get_or<std::string>("model_file", "the model"))) {}
  void warmup() {
    c10::InferenceMode inference;
    // TorchScript's profiling executor: its first runs (then once per size below).
    for (int i = 0; i < 2; ++i) model.forward(torch::zeros({1, inputs}, model.where));
    std::int64_t took = 0;
    for (std::int64_t n = 1; n <= max_batch; ++n) {
      bool power_of_two = (n & (n - 1)) == 0;
      if (!where.is_cuda() && !power_of_two && n != max_batch) continue;
      std::string why;
      try {
        // Its answer's shape too: a model of another task failed every request with a 400
        // that blamed the client.
        class_scores(model.forward(torch::zeros({n, inputs}, model.where)), n, file);
        took = n;
      } catch (const c10::Error& e) {
        if (n == 1) throw;  // not a size limit: the model itself fails
        why = e.what_without_backtrace();
      } catch (const std::runtime_error& e) {  // a TorchScript raise or assert (JITException)
        if (n == 1) throw;
        why = e.what();
      }
      if (took != n) {
        if (!told.exchange(true))
          std::cerr << "the model refuses a call of " << n << " rows (it took " << took
                    << "): larger calls are split (lower --max-batch, or export it for "
                    << max_batch << "): " << last_line(why) << std::endl;
        break;
      }
    }
  }
  std::vector<prediction> work(troupe::span<const std::vector<float>> rows) {
    classify::producer::calls += 1;
    classify::producer::rows_seen += rows.size();
    // Requests of other widths in one call cannot be stacked: this call throws and troupe runs
    // it again in halves, down to single requests, each of which the model judges alone.
    auto x = stack(rows, rows.empty() ? 0 : rows.front().size());
    c10::InferenceMode inference;
    try {
      return best_classes(model.forward(troupe::to_device(x, where)));
    } catch (const c10::OutOfMemoryError&) {
      throw;  // the device's fault, not the request's
    } catch (
        const c10::Error& e) {  // the model's own refusal (a package: AOTI_RUNTIME_CHECK_INPUTS)
      throw std::invalid_argument(bad_input + last_line(e.what_without_backtrace()));
    } catch (const std::runtime_error& e) {  // a TorchScript raise or assert (JITException)
      throw std::invalid_argument(bad_input + last_line(e.what()));
    }
  }
  troupe::device where;
  State& model;
  std::int64_t inputs;     ///< numbers per request (cfg "inputs": the reference rows' width)
  std::int64_t max_batch;  ///< the largest batch a call gets (cfg "max_batch")
  std::string file;        ///< cfg "model_name" (the file as the user named it), for its messages
  static inline std::atomic<bool> told{false};
};

/// A TorchScript model from a file (cfg "model_file"), served the same way. One copy of its
/// weights per device and process (device_state), however many producers share the device;
/// each producer warms it up once before its first request (the profiling executor's first
/// calls are slow: they stay out of the first requests' latency).
struct classify_script {
  static constexpr std::size_t width = 0;  ///< any: the model says what it takes
  struct device_state {
    device_state(const troupe::device& d, const troupe::config& cfg)
        : where(troupe::torch_device(d)),
          module(torch::jit::load(cfg.get<std::string>("model_file"), where)) {
      module.eval();
      loads += 1;
    }
    at::Tensor forward(const at::Tensor& x) { return module.forward({x}).toTensor(); }
    torch::Device where;
    torch::jit::Module module;
    static inline std::atomic<int> loads{0};
  };
  using producer = file_model_producer<device_state>;
};

/// An AOTInductor package (cfg "model_file", a .pt2 from torch.export, examples/export_model.py)
/// served the same way: compiled code, no interpreter. One loader per device and process
/// (device_state) with a model instance for each of the device's producers (cfg "runners"), so
/// that they run at once; it takes batches up to the size it was exported for (a larger one
/// throws, and troupe runs it again in halves).
struct classify_package {
  static constexpr std::size_t width = 0;  ///< any: the package checks its inputs
  struct device_state {
    device_state(const troupe::device& d, const troupe::config& cfg)
        : where(troupe::torch_device(d)),
          loader(cfg.get<std::string>("model_file"), "model", false,
                 static_cast<std::size_t>(cfg.get_or<std::int64_t>("runners", 1)),
                 where.is_cuda() ? where.index() : c10::DeviceIndex{-1}) {
      classify_script::device_state::loads += 1;
    }
    at::Tensor forward(const at::Tensor& x) { return loader.run({x}).at(0); }
    torch::Device where;
    torch::inductor::AOTIModelPackageLoader loader;
  };
  using producer = file_model_producer<device_state>;
};

namespace {

bool is_package(const std::string& model_file) {
  return model_file.size() > 4 && model_file.compare(model_file.size() - 4, 4, ".pt2") == 0;
}

/// The model in `model_file` (.pt or .pt2; `name` in messages), loaded on the CPU, as a function of
/// a batch: for the checks, apart from the producers. A package takes at most the batch it was
/// exported for: the rows go through in slices of 64 (export_model.py's default), halved while the
/// model refuses.
std::function<at::Tensor(const at::Tensor&)> load_model(const std::string& model_file,
                                                        const std::string& name) {
  std::function<at::Tensor(const at::Tensor&)> forward;
  try {
    if (is_package(model_file)) {
      auto loader = std::make_shared<torch::inductor::AOTIModelPackageLoader>(model_file);
      forward = [loader](const at::Tensor& x) { return loader->run({x}).at(0); };
    } else {
      auto module = std::make_shared<torch::jit::Module>(torch::jit::load(model_file));
      module->eval();
      forward = [module](const at::Tensor& x) { return module->forward({x}).toTensor(); };
    }
  } catch (const c10::Error& e) {  // its words, without LibTorch's C++ backtrace
    throw std::runtime_error(name + ": " + last_line(e.what_without_backtrace()));
  }
  return [forward](const at::Tensor& x) {
    std::vector<at::Tensor> parts;
    std::int64_t step = 64;
    for (std::int64_t at = 0; at < x.size(0);) {
      auto end = std::min<std::int64_t>(x.size(0), at + step);
      try {
        parts.push_back(forward(x.slice(0, at, end)));
      } catch (const c10::Error&) {
        if (end - at == 1) throw;
        step = (end - at) / 2;
        continue;
      }
      at = end;
    }
    return torch::cat(parts).contiguous();
  };
}

/// `y`, a model's answer to `rows` rows, as `rows` x 10 floats in memory; throws when it is not
/// that shape (a model of another task: its answer is never read past its end).
at::Tensor class_scores(const at::Tensor& y, std::int64_t rows, const std::string& model_file) {
  if (y.dim() != 2 || y.size(0) != rows || y.size(1) != static_cast<std::int64_t>(n_classes) ||
      y.scalar_type() != at::kFloat)
    throw std::runtime_error(model_file + " answers " + std::to_string(rows) +
                             " rows with a tensor of shape " + c10::str(y.sizes()) + " (" +
                             std::string{c10::toString(y.scalar_type())} + "), not " +
                             std::to_string(rows) + " x " + std::to_string(n_classes) +
                             " floats: the scores of the 10 classes");
  return y.contiguous();
}

/// FILE.ref.txt (examples/export_model.py): each line's inputs (16 for serve's default model, as
/// many as the model reads for one exported with --channels/--side) and the 10 scores Python
/// computed. Throws when the model loaded here answers otherwise (beyond float rounding). `name`:
/// the model file as the user named it, for messages.
std::size_t check_reference(const std::string& model_file, const std::string& name,
                            std::int64_t& width) {
  std::ifstream in(model_file + ".ref.txt");
  if (!in) return 0;
  auto forward = load_model(model_file, name);
  c10::InferenceMode inference;
  std::string line;
  std::size_t rows = 0;
  while (std::getline(in, line)) {
    auto semi = line.find(';');
    if (semi == std::string::npos) continue;
    std::istringstream xs(line.substr(0, semi)), ys(line.substr(semi + 1));
    std::vector<float> x, y;
    for (float v; xs >> v;) x.push_back(v);
    for (float v; ys >> v;) y.push_back(v);
    if (x.empty() || x.size() > max_width || y.size() != n_classes)
      throw std::runtime_error(name + ".ref.txt: a line without inputs and 10 scores");
    width = static_cast<std::int64_t>(x.size());
    auto got = class_scores(forward(torch::from_blob(x.data(), {1, width}).clone()), 1, name);
    for (std::size_t c = 0; c < n_classes; ++c)
      if (std::fabs(got.data_ptr<float>()[c] - y[c]) > 1e-4f * (1.0f + std::fabs(y[c])))
        throw std::runtime_error(name + " answers " + std::to_string(got.data_ptr<float>()[c]) +
                                 " for class " + std::to_string(c) + " of reference row " +
                                 std::to_string(rows) + ", Python computed " +
                                 std::to_string(y[c]));
    rows += 1;
  }
  return rows;
}

}  // namespace
#endif
