// serve: an HTTP inference server on a troupe pool with dynamic batching across callers.
//
//   POST /predict  body: 16 numbers ("0.1,0.2,..." or "[0.1, 0.2, ...]")
//                  header X-Deadline-Ms: N (optional): 504 once it has passed
//     ──▶ a 1-item job ──▶ the batcher (options::batching) gathers the waiting requests of all
//         callers ──▶ one producer::work(span) call for up to --max-batch of them ──▶ each
//         answer back to its own request: {"class": K, "score": S}
//   GET /metrics (with troupe::metrics), GET /health
//   503 when --max-queued requests wait already (troupe::overloaded), 400 on a bad body, and
//   400 with the model's own message when a model from a file refuses a request (a wrong
//   shape): only that request fails, the ones batched with it are answered.
//
// One thread runs the HTTP side (Boost.Beast coroutines): no thread waits for a request's
// answer (troupe::async_get completes the coroutine). Two models answer 10 classes:
//   --model linear  a small linear classifier in plain C++ (the default);
//   --model mlp     a LibTorch MLP (16 -> --hidden x --layers, ReLU -> 10) on each producer's
//                   device, cpu or cuda:N: one forward pass per batch (builds with LibTorch);
//   --model F.pt    a TorchScript model exported from Python ([N, 16] -> [N, 10]; see
//                   examples/export_model.py; requests of any width reach it, and it says
//                   which it takes): loaded once per device (a device_state shared
//                   by that device's producers), warmed up before the first request, checked
//                   against F.pt.ref.txt when that file is there.
//   --model F.pt2   the same model from torch.export, compiled ahead of time by AOTInductor
//                   (examples/export_model.py F.pt2): one loader per device, an instance of
//                   the model per producer; its input checks on (AOTI_RUNTIME_CHECK_INPUTS).
// --call-us and --item-us add a simulated cost per call and per row (a kernel launch, a forward
// pass), so that batching pays on a CPU as it does on a GPU.
//
//   serve --listen 127.0.0.1:8080 --devices cpu,cpu --max-batch 8 --max-delay-us 2000
//   serve --model mlp --devices cuda:0,cuda:0 --max-batch 64 --max-delay-us 1000
//   serve --requests 2000 --concurrency 64    (serves itself, checks every answer, exits)
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <list>
#include <random>
#include <sstream>
#include <troupe/asio.hpp>
#include <troupe/detail/json.hpp>
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

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

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
        file(cfg.get_or<std::string>("model_file", "the model")) {}
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
  std::string file;        ///< cfg "model_file", for its messages
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

/// The model in `model_file` (.pt or .pt2), loaded on the CPU, as a function of a batch: for the
/// checks, apart from the producers. A package takes at most the batch it was exported for: the
/// rows go through in slices of 64 (export_model.py's default), halved while the model refuses.
std::function<at::Tensor(const at::Tensor&)> load_model(const std::string& model_file) {
  std::function<at::Tensor(const at::Tensor&)> forward;
  if (is_package(model_file)) {
    auto loader = std::make_shared<torch::inductor::AOTIModelPackageLoader>(model_file);
    forward = [loader](const at::Tensor& x) { return loader->run({x}).at(0); };
  } else {
    auto module = std::make_shared<torch::jit::Module>(torch::jit::load(model_file));
    module->eval();
    forward = [module](const at::Tensor& x) { return module->forward({x}).toTensor(); };
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
/// computed. Throws when the model loaded here answers otherwise (beyond float rounding).
std::size_t check_reference(const std::string& model_file, std::int64_t& width) {
  std::ifstream in(model_file + ".ref.txt");
  if (!in) return 0;
  auto forward = load_model(model_file);
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
      throw std::runtime_error(model_file + ".ref.txt: a line without inputs and 10 scores");
    width = static_cast<std::int64_t>(x.size());
    auto got = class_scores(forward(torch::from_blob(x.data(), {1, width}).clone()), 1, model_file);
    for (std::size_t c = 0; c < n_classes; ++c)
      if (std::fabs(got.data_ptr<float>()[c] - y[c]) > 1e-4f * (1.0f + std::fabs(y[c])))
        throw std::runtime_error(model_file + " answers " +
                                 std::to_string(got.data_ptr<float>()[c]) + " for class " +
                                 std::to_string(c) + " of reference row " + std::to_string(rows) +
                                 ", Python computed " + std::to_string(y[c]));
    rows += 1;
  }
  return rows;
}

}  // namespace
#endif

namespace {

/// "0.1,0.2" or "[0.1, 0.2]": the numbers; nullopt when they are not `width` numbers (0: any
/// count from 1 to max_width, for a model from a file, which says itself what it takes).
std::optional<std::vector<float>> parse_features(const std::string& body, std::size_t width) {
  std::string s;
  for (char c : body)
    if (c != '[' && c != ']' && c != ' ' && c != '\n' && c != '\r' && c != '\t') s += c;
  std::vector<float> out;
  std::stringstream in{s};
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      std::size_t used = 0;
      float v = std::stof(item, &used);
      if (used != item.size() || !std::isfinite(v)) return std::nullopt;
      out.push_back(v);
    } catch (const std::exception&) {
      return std::nullopt;
    }
    if (out.size() > max_width) return std::nullopt;
  }
  if (width != 0 ? out.size() != width : out.empty()) return std::nullopt;
  return out;
}

struct server_state {
  std::size_t width = n_features;  ///< numbers per request (parse_features; 0: the model says)
  std::atomic<std::uint64_t> ok{0}, overloaded{0}, late{0}, bad{0};
};

http::response<http::string_body> reply(const http::request<http::string_body>& req,
                                        http::status status, std::string body,
                                        const char* type = "application/json") {
  http::response<http::string_body> res{status, req.version()};
  res.set(http::field::server, "troupe-serve");
  res.set(http::field::content_type, type);
  res.keep_alive(req.keep_alive());
  res.body() = std::move(body);
  res.prepare_payload();
  return res;
}

template <class Runner>
net::awaitable<http::response<http::string_body>> handle(http::request<http::string_body> req,
                                                         Runner& runner, server_state& stats) {
  if (req.target() == "/health") co_return reply(req, http::status::ok, "ok\n", "text/plain");
#ifdef TROUPE_EXAMPLES_METRICS
  if (req.target() == "/metrics")
    co_return reply(req, http::status::ok, troupe::metrics_text(), "text/plain; version=0.0.4");
#endif
  if (req.target() != "/predict" || req.method() != http::verb::post)
    co_return reply(req, http::status::not_found, "{\"error\": \"POST /predict\"}\n");
  auto x = parse_features(req.body(), stats.width);
  if (!x) {
    stats.bad += 1;
    co_return reply(req, http::status::bad_request,
                    stats.width != 0
                        ? "{\"error\": \"the body must be " + std::to_string(stats.width) +
                              " comma-separated numbers\"}\n"
                        : "{\"error\": \"the body must be 1 to " + std::to_string(max_width) +
                              " comma-separated numbers\"}\n");
  }
  troupe::job_options o;
  if (auto d = req.find("X-Deadline-Ms"); d != req.end()) {
    // Milliseconds, a whole number from 0 to a day: nothing before or after it ("10abc").
    std::string text{d->value()};
    std::size_t used = 0;
    long ms = -1;
    try {
      ms = std::stol(text, &used);
    } catch (const std::exception&) {
    }
    if (used != text.size() || ms < 0 || ms > 86'400'000)
      co_return reply(req, http::status::bad_request,
                      "{\"error\": \"X-Deadline-Ms must be milliseconds from 0 to 86400000\"}\n");
    o.deadline = std::chrono::milliseconds{ms};
  }
  std::optional<troupe::job_handle<std::vector<prediction>>> job;
  try {
    job = runner.submit(std::vector<std::vector<float>>{std::move(*x)}, o);
  } catch (const troupe::overloaded& e) {
    stats.overloaded += 1;
    co_return reply(req, http::status::service_unavailable,
                    std::string{"{\"error\": \"overloaded\"}\n"});
  } catch (const std::invalid_argument& e) {  // the request's own options, refused
    stats.bad += 1;
    co_return reply(req, http::status::bad_request,
                    "{\"error\": " + troupe::detail::json_quote(e.what()) + "}\n");
  } catch (const std::exception& e) {  // the runner's (closed, say): answered, not dropped
    co_return reply(req, http::status::service_unavailable,
                    "{\"error\": " + troupe::detail::json_quote(e.what()) + "}\n");
  }
  std::exception_ptr failure;
  std::vector<prediction> out;
  try {
    out = co_await troupe::async_get(std::move(*job), net::use_awaitable);
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const troupe::deadline_exceeded&) {
      stats.late += 1;
      co_return reply(req, http::status::gateway_timeout, "{\"error\": \"deadline\"}\n");
    } catch (const std::exception& e) {
      // A batch call that throws is run again in halves down to single requests (troupe's
      // batching), so a refusal names this request's own input, not its neighbours'.
      std::string what = e.what();
      if (auto at = what.find(bad_input); at != std::string::npos) {
        stats.bad += 1;
        co_return reply(req, http::status::bad_request,
                        "{\"error\": " + troupe::detail::json_quote(what.substr(at)) + "}\n");
      }
      co_return reply(req, http::status::internal_server_error,
                      "{\"error\": " + troupe::detail::json_quote(what) + "}\n");
    }
  }
  if (!std::isfinite(out.at(0).score))  // JSON has no NaN or infinity: the model's fault
    co_return reply(req, http::status::internal_server_error,
                    "{\"error\": \"the model's score is not a finite number\"}\n");
  stats.ok += 1;
  std::ostringstream body;
  body << "{\"class\": " << out.at(0).label << ", \"score\": " << out.at(0).score << "}\n";
  co_return reply(req, http::status::ok, body.str());
}

/// The connections, on the I/O thread: how many, and those waiting for a request, oldest first.
/// At the limit (below the process's descriptors), the oldest waiting one is closed to make
/// room: silent clients cannot lock the others out, and accept() never runs out of descriptors.
struct connection;
struct connections {
  std::size_t open = 0, limit = 1024;
  std::list<connection*> waiting;
};
struct connection {
  connection(tcp::socket s, std::shared_ptr<connections> all)
      : stream(std::move(s)), all(std::move(all)) {
    this->all->open += 1;
  }
  ~connection() {
    unlist();
    all->open -= 1;
  }
  connection(const connection&) = delete;
  connection& operator=(const connection&) = delete;
  void list() { at = all->waiting.insert(all->waiting.end(), this); }
  void unlist() {
    if (at) all->waiting.erase(*at);
    at.reset();
  }
  beast::tcp_stream stream;
  std::shared_ptr<connections> all;
  std::optional<std::list<connection*>::iterator> at;
};

/// Closes `stream` unless the operation awaited in its scope ends within `d` (the operation then
/// fails, operation_aborted). Not beast's own expires_after: its beast::error::timeout's error
/// category object trips UBSan's vptr check in this build (Boost 1.81, GCC 12), where asio's
/// errors do not.
struct time_limit {
  time_limit(beast::tcp_stream& stream, std::chrono::seconds d)
      : timer(stream.get_executor()), on(std::make_shared<bool>(true)) {
    timer.expires_after(d);
    timer.async_wait([&stream, on = on](const beast::error_code& e) {
      if (!e && *on) stream.close();  // `on`: the stream is still the scope's (a handler that
    });                               // fired as the operation ended may run after it)
  }
  ~time_limit() {
    *on = false;
    timer.cancel();
  }
  time_limit(const time_limit&) = delete;
  time_limit& operator=(const time_limit&) = delete;
  net::steady_timer timer;
  std::shared_ptr<bool> on;
};

template <class Runner>
net::awaitable<void> session(tcp::socket socket, Runner& runner, server_state& stats,
                             std::shared_ptr<connections> all) {
  connection c{std::move(socket), std::move(all)};
  auto* stream = &c.stream;
  beast::flat_buffer buffer;
  try {
    for (;;) {
      http::request<http::string_body> req;
      c.list();
      {
        time_limit limit{*stream, std::chrono::seconds{30}};  // an idle or slow client is let go
        co_await http::async_read(*stream, buffer, req, net::use_awaitable);
      }
      c.unlist();
      bool keep = req.keep_alive();
      auto res = co_await handle(std::move(req), runner, stats);
      // A client that never reads its answers is let go too: its write would wait forever, and
      // it is not among those waiting for a request, which a newcomer may close.
      beast::error_code ec;  // a failed write (cut off, reset) ends the session, unthrown
      {
        time_limit limit{*stream, std::chrono::seconds{30}};
        co_await http::async_write(*stream, res, net::redirect_error(net::use_awaitable, ec));
      }
      if (ec || !keep) break;
    }
  } catch (const std::exception&) {
    // the client closed the connection, sent garbage, was too slow or made room for another
  }
  beast::error_code ec;
  stream->socket().shutdown(tcp::socket::shutdown_send, ec);
}

template <class Runner>
net::awaitable<void> listen(tcp::acceptor& acceptor, Runner& runner, server_state& stats) {
  auto all = std::make_shared<connections>();
  if (rlimit lim{}; getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY)
    all->limit = std::max<std::size_t>(8, static_cast<std::size_t>(lim.rlim_cur) / 2);
  for (;;) {
    beast::error_code ec;
    auto socket = co_await acceptor.async_accept(net::redirect_error(net::use_awaitable, ec));
    if (ec == net::error::operation_aborted) co_return;
    if (ec) {  // out of descriptors after all, say: a moment, then accept again
      net::steady_timer pause{acceptor.get_executor(), std::chrono::milliseconds{10}};
      co_await pause.async_wait(net::use_awaitable);
      continue;
    }
    if (all->open >= all->limit && !all->waiting.empty()) {
      auto* oldest = all->waiting.front();
      oldest->unlist();
      oldest->stream.close();  // its read fails: that session ends
    }
    net::co_spawn(acceptor.get_executor(), session(std::move(socket), runner, stats, all),
                  net::detached);
  }
}

/// The self-test's request `i`: its `width` numbers (16; a model from a file: as many as its
/// reference rows hold), exactly as the body's text says them.
std::vector<float> request_input(std::size_t i, std::size_t width) {
  std::mt19937 rng{static_cast<unsigned>(i)};
  std::uniform_real_distribution<float> u{-1.0f, 1.0f};
  std::vector<float> x(width);
  for (auto& v : x) v = std::round(u(rng) * 1000.0f) / 1000.0f;
  return x;
}

/// The self-test: requests first, first + stride, ... below n on one connection; the class of
/// each answer into `got` (-1 when it failed, minus the status for an error answer), its latency
/// into `latencies_ms`.
net::awaitable<void> client(tcp::endpoint to, std::size_t first, std::size_t n, std::size_t stride,
                            std::size_t width, std::vector<std::int64_t>& got,
                            std::vector<double>& latencies_ms) {
  beast::tcp_stream stream{co_await net::this_coro::executor};
  co_await stream.async_connect(to, net::use_awaitable);
  beast::flat_buffer buffer;
  for (std::size_t i = first; i < n; i += stride) {
    std::string body;
    for (auto v : request_input(i, width)) {
      std::ostringstream s;
      s << v;
      body += (body.empty() ? "" : ",") + s.str();
    }
    http::request<http::string_body> req{http::verb::post, "/predict", 11};
    req.set(http::field::host, "localhost");
    req.body() = body;
    req.prepare_payload();
    auto sent = std::chrono::steady_clock::now();
    co_await http::async_write(stream, req, net::use_awaitable);
    http::response<http::string_body> res;
    co_await http::async_read(stream, buffer, res, net::use_awaitable);
    latencies_ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - sent).count());
    auto at = res.body().find("\"class\": ");
    if (res.result() == http::status::ok && at != std::string::npos)
      got[i] = std::stol(res.body().substr(at + 9));
    else
      got[i] = -static_cast<std::int64_t>(res.result_int());  // answered, with an error
  }
  beast::error_code ec;
  stream.socket().shutdown(tcp::socket::shutdown_both, ec);
}

/// Every class score of the model for the self-test's `n` requests, computed here in one go.
std::vector<std::vector<float>> reference_scores(const std::string& model, std::size_t n,
                                                 [[maybe_unused]] const troupe::config& cfg) {
  std::vector<std::vector<float>> scores(n, std::vector<float>(n_classes));
  if (model == "linear") {
    auto w = weights();
    for (std::size_t i = 0; i < n; ++i) {
      auto x = request_input(i, n_features);
      for (std::size_t c = 0; c < n_classes; ++c)
        for (std::size_t f = 0; f < n_features; ++f) scores[i][c] += w[c * n_features + f] * x[f];
    }
    return scores;
  }
#ifdef TROUPE_EXAMPLES_TORCH
  std::vector<std::vector<float>> inputs;
  auto width = static_cast<std::size_t>(cfg.get_or<std::int64_t>("inputs", n_features));
  for (std::size_t i = 0; i < n; ++i) inputs.push_back(request_input(i, width));
  c10::InferenceMode inference;
  auto x = stack(troupe::span<const std::vector<float>>{inputs.data(), inputs.size()}, width);
  at::Tensor y;
  if (model == "mlp") {
    y = make_mlp(cfg.get_or<std::int64_t>("hidden", 256), cfg.get_or<std::int64_t>("layers", 2))
            ->forward(x)
            .contiguous();
  } else {
    // A row at a time: a model from a file may refuse larger calls (the warm-up said so).
    auto forward = load_model(model);
    std::vector<at::Tensor> rows;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(n); ++i)
      rows.push_back(class_scores(forward(x.slice(0, i, i + 1)), 1, model));
    y = rows.empty() ? torch::zeros({0, static_cast<std::int64_t>(n_classes)}) : torch::cat(rows);
  }
  const auto* p = y.data_ptr<float>();
  for (auto& row : scores) {
    std::copy_n(p, n_classes, row.begin());
    p += n_classes;
  }
#endif
  return scores;
}

/// Answers that are not the model's best class (ties within rounding count as right).
std::size_t wrong_answers(const std::vector<std::int64_t>& got,
                          const std::vector<std::vector<float>>& scores) {
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    auto best = *std::max_element(scores[i].begin(), scores[i].end());
    if (got[i] < 0 || got[i] >= static_cast<std::int64_t>(n_classes) ||
        scores[i][static_cast<std::size_t>(got[i])] < best - 1e-3f * (1.0f + std::fabs(best)))
      wrong += 1;
  }
  return wrong;
}

/// Serves on `listen_on` with a runner of `Job` until SIGINT/SIGTERM, or, with `requests`,
/// runs the self-test and prints its result.
template <class Job>
void serve(const example::flags& f, const troupe::config& cfg, troupe::options opts,
           const std::string& model, const std::string& listen_on, std::size_t requests,
           std::size_t concurrency) {
  troupe::unordered_runner<Job> runner{f.device_list(), cfg, opts};
  server_state stats;
  stats.width = Job::width;

  net::io_context io{1};
  auto hp = troupe::detail::parse_host_port(listen_on);
  tcp::endpoint at{net::ip::make_address(hp.host), hp.port};
  tcp::acceptor acceptor{io, at};
  auto port = acceptor.local_endpoint().port();
  std::cerr << "serving HTTP on " << hp.host << ":" << port << " (POST /predict)" << std::endl;
  net::co_spawn(io, listen(acceptor, runner, stats), net::detached);
  if (requests == 0) {
    net::signal_set signals{io, SIGINT, SIGTERM};
    signals.async_wait([&](const beast::error_code&, int) { io.stop(); });
    io.run();
    std::cout << "result: " << stats.ok << " requests served\n";
    return;
  }
  std::vector<std::int64_t> got(requests, -1);
  std::size_t done = 0, broken = 0;
  std::vector<double> latencies_ms;
  auto start = std::chrono::steady_clock::now();
  tcp::endpoint to{net::ip::make_address(hp.host), port};
  for (std::size_t c = 0; c < concurrency; ++c)
    net::co_spawn(io,
                  client(to, c, requests, concurrency,
                         static_cast<std::size_t>(cfg.get_or<std::int64_t>("inputs", n_features)),
                         got, latencies_ms),
                  [&](std::exception_ptr e) {
                    if (e) broken += 1;
                    if (++done == concurrency) io.stop();
                  });
  io.run();
  auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto s = runner.stats();
  std::sort(latencies_ms.begin(), latencies_ms.end());
  auto pct = [&](double q) {
    return latencies_ms.empty()
               ? 0.0
               : latencies_ms[std::min(
                     latencies_ms.size() - 1,
                     static_cast<std::size_t>(q * static_cast<double>(latencies_ms.size())))];
  };
  auto scores = reference_scores(model, requests, cfg);
  // A request that got no answer (its connection failed: too many for the descriptors, say) is
  // not a wrong answer: counted apart, and a failure too.
  auto unanswered = static_cast<std::size_t>(std::count(got.begin(), got.end(), -1));
  auto refused = static_cast<std::size_t>(
      std::count_if(got.begin(), got.end(), [](std::int64_t g) { return g < -1; }));
  auto wrong = wrong_answers(got, scores) - unanswered - refused;  // they count there too
  std::cerr << "latency p50 " << pct(0.5) << " ms, p99 " << pct(0.99) << " ms" << std::endl;
  std::cerr << "served " << stats.ok << " requests in " << secs << " s ("
            << static_cast<double>(stats.ok) / secs << " requests/s), " << wrong << " wrong, "
            << unanswered << " unanswered (" << broken << " connections failed), " << refused
            << " answered with an error status; " << classify::producer::calls
            << " model calls (mean batch "
            << static_cast<double>(classify::producer::rows_seen) /
                   static_cast<double>(std::max<std::uint64_t>(1, classify::producer::calls))
            << "), " << s.split_calls << " calls made again after a throw" << std::endl;
  if (unanswered != 0)
    throw std::runtime_error(std::to_string(unanswered) + " requests unanswered: " +
                             std::to_string(broken) + " connections failed (fewer --concurrency?)");
  if (refused != 0)
    throw std::runtime_error(std::to_string(refused) +
                             " requests answered with an error status (the log above says why)");
  if (wrong != 0) throw std::runtime_error(std::to_string(wrong) + " wrong answers");
  std::int64_t classes = 0;
  for (auto g : got) classes += g;
  std::cout << "result: " << classes << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"serve: an HTTP inference server on troupe producers, batching across callers"};
  example::flags f;
  example::add_flags(app, f);
  std::string listen_on = "127.0.0.1:8080", model = "linear";
  std::size_t max_batch = 8, max_queued = 4096, requests = 0, concurrency = 16;
  std::int64_t max_delay_us = 2000, call_us = 0, item_us = 0, hidden = 256, layers = 2;
  app.add_option("--listen", listen_on, "HOST:PORT to serve HTTP on (port 0: any free port)");
  app.add_option("--model", model,
                 "linear (plain C++), mlp (LibTorch, on the producers' devices), FILE.pt (a "
                 "TorchScript model [N,16] -> [N,10], e.g. from examples/export_model.py) or "
                 "FILE.pt2 (the same from torch.export, compiled by AOTInductor)")
      ->check([](const std::string& m) -> std::string {
        if (m == "linear" || m == "mlp") return {};
        if (m.size() > 3 && m.compare(m.size() - 3, 3, ".pt") == 0) return {};
        if (m.size() > 4 && m.compare(m.size() - 4, 4, ".pt2") == 0) return {};
        return "--model: linear, mlp, a FILE.pt or a FILE.pt2";
      });
  app.add_option("--hidden", hidden, "--model mlp: hidden units per layer")
      ->check(CLI::PositiveNumber);
  app.add_option("--layers", layers, "--model mlp: hidden layers")->check(CLI::PositiveNumber);
  app.add_option("--max-batch", max_batch, "most requests per producer call (0: no batching)")
      ->check(CLI::Range(std::size_t{0}, std::size_t{65'536}));
  app.add_option("--max-delay-us", max_delay_us,
                 "how long a request may wait for others when the batch is not full");
  app.add_option("--max-queued", max_queued, "waiting requests beyond which it answers 503")
      ->check(CLI::Range(std::size_t{1}, std::size_t{100'000'000}));
  app.add_option("--call-us", call_us, "simulated cost of one model call, in microseconds")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{86'400'000'000}));
  app.add_option("--item-us", item_us, "simulated cost per request in a call, in microseconds")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1'000'000'000}));
  app.add_option("--requests", requests,
                 "serve this many requests of its own (--concurrency connections), check every "
                 "answer, print the result and exit");
  app.add_option("--concurrency", concurrency, "connections of the self-test")
      ->check(CLI::Range(std::size_t{1}, std::size_t{10'000}));
  CLI11_PARSE(app, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;
  if ((call_us != 0 || item_us != 0) && model != "linear" && model != "mlp") {
    std::cerr << "--call-us and --item-us simulate the cost of the linear and mlp models; a "
                 "model from a file costs what it costs\n";
    return 2;
  }
  return example::guarded([&] {
    troupe::config cfg;
    cfg.set("call_us", call_us);
    cfg.set("item_us", item_us);
    cfg.set("hidden", hidden);
    cfg.set("layers", layers);
    cfg.set("max_batch", static_cast<std::int64_t>(max_batch));
    auto opts = f.options();
    opts.batching.max_items = max_batch;
    opts.batching.max_delay = std::chrono::microseconds{max_delay_us};
    opts.max_queued_items = max_queued;
    opts.speculative = false;
    if (model == "linear")
      return serve<classify>(f, cfg, opts, model, listen_on, requests, concurrency);
#ifdef TROUPE_EXAMPLES_TORCH
    if (model == "mlp")
      return serve<classify_mlp>(f, cfg, opts, model, listen_on, requests, concurrency);
    // A package checks its inputs' shapes only when asked (read once, at its first run): a
    // request of a wrong shape is then an error (a 400), not a read past its buffer.
    if (is_package(model)) ::setenv("AOTI_RUNTIME_CHECK_INPUTS", "1", 0);
    std::int64_t width = n_features;  // what a request holds: the reference rows say
    if (auto rows = check_reference(model, width); rows > 0)
      std::cerr << "reference: " << model << " gives Python's scores on " << rows << " rows of "
                << width << " inputs" << std::endl;
    cfg.set("model_file", model);
    cfg.set("inputs", width);
    if (is_package(model)) {
      // Each producer of a device runs its own instance of the package's model at once.
      auto ds = f.device_list();
      std::int64_t most = 1;
      for (auto& d : ds) most = std::max<std::int64_t>(most, std::count(ds.begin(), ds.end(), d));
      cfg.set("runners", most);
      serve<classify_package>(f, cfg, opts, model, listen_on, requests, concurrency);
    } else {
      serve<classify_script>(f, cfg, opts, model, listen_on, requests, concurrency);
    }
    std::cerr << "model loaded " << classify_script::device_state::loads
              << " time(s): once per device" << std::endl;
#else
    throw std::invalid_argument("--model " + model + ": this serve was built without LibTorch");
#endif
  });
}
