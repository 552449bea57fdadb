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
//   shape): only that request fails, the ones batched with it are answered. A body over 4 MiB
//   is a 413 and bytes that are not HTTP a 400, each followed by the connection's close.
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
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <iostream>
#include <random>
#include <sstream>
#include <troupe/asio.hpp>

#include "common/cli.hpp"
#include "model_snapshot.hpp"
#include "serve_http.hpp"
#include "serve_models.hpp"

namespace {

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
    auto forward = load_model(cfg.get<std::string>("model_file"), model);
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

/// SIGINT and SIGTERM held (`hold`) or let through, in this thread and the threads it starts
/// later: held while serve starts (copying the model file, loading it on each device), a signal
/// then ends serve once it waits for signals, the same way out as later, which removes the
/// model's copy (their default action would end the process where it is, the copy left).
void hold_stop_signals(bool hold) {
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(hold ? SIG_BLOCK : SIG_UNBLOCK, &stop, nullptr);
}

/// Serves on `listen_on` with a runner of `Job` until SIGINT/SIGTERM, or, with `requests`,
/// runs the self-test and prints its result (a signal cuts it short: an error).
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
  net::signal_set signals{io, SIGINT, SIGTERM};
  bool stopped = false;
  signals.async_wait([&](const beast::error_code& ec, int) {
    if (ec) return;
    stopped = true;
    io.stop();
  });
  hold_stop_signals(false);  // one that came while serve started is taken now
  if (requests == 0) {
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
  if (stopped) throw std::runtime_error("stopped by a signal before the self-test's end");
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
    hold_stop_signals(true);  // until serve() waits for them
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
    // One version of the file for every load below (model_snapshot.hpp).
    model_snapshot file{model};
    std::int64_t width = n_features;  // what a request holds: the reference rows say
    if (auto rows = check_reference(file.path(), model, width); rows > 0)
      std::cerr << "reference: " << model << " gives Python's scores on " << rows << " rows of "
                << width << " inputs" << std::endl;
    cfg.set("model_file", file.path());
    cfg.set("model_name", model);
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
