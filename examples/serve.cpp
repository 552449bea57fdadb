// serve: an HTTP inference server on a troupe pool with dynamic batching across callers.
//
//   POST /predict  body: 16 numbers ("0.1,0.2,..." or "[0.1, 0.2, ...]")
//                  header X-Deadline-Ms: N (optional): 504 once it has passed
//     ──▶ a 1-item job ──▶ the batcher (options::batching) gathers the waiting requests of all
//         callers ──▶ one producer::work(span) call for up to --max-batch of them ──▶ each
//         answer back to its own request: {"class": K, "score": S}
//   GET /metrics (with troupe::metrics), GET /health
//   503 when --max-queued requests wait already (troupe::overloaded), 400 on a bad body.
//
// One thread runs the HTTP side (Boost.Beast coroutines): no thread waits for a request's
// answer (troupe::async_get completes the coroutine). The model is a small linear classifier in
// plain C++; --call-us and --item-us add the cost of a device call (a kernel launch, a forward
// pass) and of each row, so that batching pays as it does on a GPU.
//
//   serve --listen 127.0.0.1:8080 --devices cpu,cpu --max-batch 8 --max-delay-us 2000
//   serve --requests 2000 --concurrency 64    (serves itself, checks every answer, exits)
#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <random>
#include <sstream>
#include <troupe/asio.hpp>

#include "common/cli.hpp"

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

namespace {

constexpr std::size_t n_features = 16, n_classes = 10;

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

namespace {

/// "0.1,0.2" or "[0.1, 0.2]": the numbers; nullopt when it is not 16 numbers.
std::optional<std::vector<float>> parse_features(const std::string& body) {
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
  }
  if (out.size() != n_features) return std::nullopt;
  return out;
}

struct server_stats {
  std::atomic<std::uint64_t> ok{0}, overloaded{0}, late{0}, bad{0};
};

using runner_type = troupe::unordered_runner<classify>;

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

net::awaitable<http::response<http::string_body>> handle(http::request<http::string_body> req,
                                                         runner_type& runner, server_stats& stats) {
  if (req.target() == "/health") co_return reply(req, http::status::ok, "ok\n", "text/plain");
#ifdef TROUPE_EXAMPLES_METRICS
  if (req.target() == "/metrics")
    co_return reply(req, http::status::ok, troupe::metrics_text(), "text/plain; version=0.0.4");
#endif
  if (req.target() != "/predict" || req.method() != http::verb::post)
    co_return reply(req, http::status::not_found, "{\"error\": \"POST /predict\"}\n");
  auto x = parse_features(req.body());
  if (!x) {
    stats.bad += 1;
    co_return reply(req, http::status::bad_request,
                    "{\"error\": \"the body must be 16 comma-separated numbers\"}\n");
  }
  troupe::job_options o;
  if (auto d = req.find("X-Deadline-Ms"); d != req.end()) {
    try {
      o.deadline = std::chrono::milliseconds{std::stol(std::string{d->value()})};
    } catch (const std::exception&) {
      co_return reply(req, http::status::bad_request, "{\"error\": \"bad X-Deadline-Ms\"}\n");
    }
  }
  std::optional<troupe::job_handle<std::vector<prediction>>> job;
  try {
    job = runner.submit(std::vector<std::vector<float>>{std::move(*x)}, o);
  } catch (const troupe::overloaded& e) {
    stats.overloaded += 1;
    co_return reply(req, http::status::service_unavailable,
                    std::string{"{\"error\": \"overloaded\"}\n"});
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
      co_return reply(req, http::status::internal_server_error,
                      std::string{"{\"error\": \""} + e.what() + "\"}\n");
    }
  }
  stats.ok += 1;
  std::ostringstream body;
  body << "{\"class\": " << out.at(0).label << ", \"score\": " << out.at(0).score << "}\n";
  co_return reply(req, http::status::ok, body.str());
}

net::awaitable<void> session(tcp::socket socket, runner_type& runner, server_stats& stats) {
  beast::tcp_stream stream{std::move(socket)};
  beast::flat_buffer buffer;
  try {
    for (;;) {
      http::request<http::string_body> req;
      stream.expires_after(std::chrono::seconds{30});  // an idle or slow client is let go
      co_await http::async_read(stream, buffer, req, net::use_awaitable);
      stream.expires_never();
      bool keep = req.keep_alive();
      auto res = co_await handle(std::move(req), runner, stats);
      co_await http::async_write(stream, res, net::use_awaitable);
      if (!keep) break;
    }
  } catch (const std::exception&) {
    // the client closed the connection, sent garbage, or was too slow: this session ends
  }
  beast::error_code ec;
  stream.socket().shutdown(tcp::socket::shutdown_send, ec);
}

net::awaitable<void> listen(tcp::acceptor& acceptor, runner_type& runner, server_stats& stats) {
  for (;;) {
    auto socket = co_await acceptor.async_accept(net::use_awaitable);
    net::co_spawn(acceptor.get_executor(), session(std::move(socket), runner, stats),
                  net::detached);
  }
}

/// The self-test: `n` requests over `concurrency` connections, every answer checked against
/// the model; the sum of the predicted classes.
net::awaitable<void> client(tcp::endpoint to, std::size_t first, std::size_t n, std::size_t stride,
                            std::int64_t& classes, std::size_t& wrong,
                            std::vector<double>& latencies_ms) {
  beast::tcp_stream stream{co_await net::this_coro::executor};
  co_await stream.async_connect(to, net::use_awaitable);
  beast::flat_buffer buffer;
  auto w = weights();
  for (std::size_t i = first; i < n; i += stride) {
    std::mt19937 rng{static_cast<unsigned>(i)};
    std::uniform_real_distribution<float> u{-1.0f, 1.0f};
    std::vector<float> x(n_features);
    std::string body;
    for (auto& v : x) {
      v = std::round(u(rng) * 1000.0f) / 1000.0f;  // exactly what the text says
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
    auto want = predict(w, *parse_features(body));
    auto at = res.body().find("\"class\": ");
    if (res.result() != http::status::ok || at == std::string::npos ||
        std::stol(res.body().substr(at + 9)) != want.label)
      wrong += 1;
    classes += want.label;
  }
  beast::error_code ec;
  stream.socket().shutdown(tcp::socket::shutdown_both, ec);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"serve: an HTTP inference server on troupe producers, batching across callers"};
  example::flags f;
  example::add_flags(app, f);
  std::string listen_on = "127.0.0.1:8080";
  std::size_t max_batch = 8, max_queued = 4096, requests = 0, concurrency = 16;
  std::int64_t max_delay_us = 2000, call_us = 0, item_us = 0;
  app.add_option("--listen", listen_on, "HOST:PORT to serve HTTP on (port 0: any free port)");
  app.add_option("--max-batch", max_batch, "most requests per producer call (0: no batching)");
  app.add_option("--max-delay-us", max_delay_us,
                 "how long a request may wait for others when the batch is not full");
  app.add_option("--max-queued", max_queued, "waiting requests beyond which it answers 503");
  app.add_option("--call-us", call_us, "simulated cost of one model call, in microseconds");
  app.add_option("--item-us", item_us, "simulated cost per request in a call, in microseconds");
  app.add_option("--requests", requests,
                 "serve this many requests of its own (--concurrency connections), check every "
                 "answer, print the result and exit");
  app.add_option("--concurrency", concurrency, "connections of the self-test");
  CLI11_PARSE(app, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;
  return example::guarded([&] {
    troupe::config cfg;
    cfg.set("call_us", call_us);
    cfg.set("item_us", item_us);
    auto opts = f.options();
    opts.batching.max_items = max_batch;
    opts.batching.max_delay = std::chrono::microseconds{max_delay_us};
    opts.max_queued_items = max_queued;
    opts.speculative = false;
    runner_type runner{f.device_list(), cfg, opts};
    server_stats stats;

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
    std::int64_t classes = 0;
    std::size_t wrong = 0, done = 0;
    std::vector<double> latencies_ms;
    auto start = std::chrono::steady_clock::now();
    tcp::endpoint to{net::ip::make_address(hp.host), port};
    for (std::size_t c = 0; c < concurrency; ++c)
      net::co_spawn(io, client(to, c, requests, concurrency, classes, wrong, latencies_ms),
                    [&](std::exception_ptr e) {
                      if (e) wrong += 1;
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
    std::cerr << "latency p50 " << pct(0.5) << " ms, p99 " << pct(0.99) << " ms" << std::endl;
    std::cerr << "served " << stats.ok << " requests in " << secs << " s ("
              << static_cast<double>(stats.ok) / secs << " requests/s), " << wrong << " wrong; "
              << classify::producer::calls << " model calls (mean batch "
              << static_cast<double>(classify::producer::rows_seen) /
                     static_cast<double>(std::max<std::uint64_t>(1, classify::producer::calls))
              << "), " << s.split_calls << " calls made again after a throw" << std::endl;
    if (wrong != 0) throw std::runtime_error(std::to_string(wrong) + " wrong answers");
    std::cout << "result: " << classes << "\n";
  });
}
