// serve's HTTP side (examples/serve.cpp): a request's body, the server's counters, the
// connections and their limit, and the accept loop, on one thread (Boost.Beast coroutines).
// Private to serve.cpp, which includes it once.
#pragma once

#include <sys/resource.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast.hpp>
#include <cmath>
#include <cstdint>
#include <list>
#include <optional>
#include <sstream>
#include <string>
#include <troupe/asio.hpp>
#include <troupe/detail/json.hpp>
#include <vector>

#include "serve_models.hpp"

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

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

/// The largest body read: max_width numbers of up to 63 characters each with their separators
/// (a body of 65,536 numbers written out in full is over Beast's default of 1 MiB).
constexpr std::uint64_t max_body_bytes = max_width * 64;

/// The answer to a request that could not be read whole (too large, or not HTTP), when
/// `ec` says so; nullopt when the client went away or was too slow (nobody to answer).
inline std::optional<http::response<http::string_body>> unreadable(const beast::error_code& ec) {
  if (ec.category() != beast::http::make_error_code(http::error::body_limit).category() ||
      ec == http::error::end_of_stream || ec == http::error::partial_message)
    return std::nullopt;
  http::request<http::string_body> none;
  none.keep_alive(false);  // what follows an unreadable request cannot be told apart
  if (ec == http::error::body_limit)
    return reply(
        none, http::status::payload_too_large,
        "{\"error\": \"the body is over " + std::to_string(max_body_bytes) + " bytes\"}\n");
  return reply(
      none, http::status::bad_request,
      "{\"error\": " + troupe::detail::json_quote("not an HTTP request: " + ec.message()) + "}\n");
}

template <class Runner>
net::awaitable<void> session(tcp::socket socket, Runner& runner, server_state& stats,
                             std::shared_ptr<connections> all) {
  connection c{std::move(socket), std::move(all)};
  auto* stream = &c.stream;
  beast::flat_buffer buffer;
  try {
    for (;;) {
      http::request_parser<http::string_body> parser;
      parser.body_limit(max_body_bytes);
      beast::error_code ec;
      c.list();
      {
        time_limit limit{*stream, std::chrono::seconds{30}};  // an idle or slow client is let go
        co_await http::async_read(*stream, buffer, parser,
                                  net::redirect_error(net::use_awaitable, ec));
      }
      c.unlist();
      if (ec) {  // a bad request is answered (400, 413), then the connection closed
        if (auto res = unreadable(ec)) {
          stats.bad += 1;
          time_limit limit{*stream, std::chrono::seconds{30}};
          co_await http::async_write(*stream, *res, net::redirect_error(net::use_awaitable, ec));
        }
        break;
      }
      auto req = parser.release();
      bool keep = req.keep_alive();
      auto res = co_await handle(std::move(req), runner, stats);
      // A client that never reads its answers is let go too: its write would wait forever, and
      // it is not among those waiting for a request, which a newcomer may close.
      // (ec is clear here: a failed write, cut off or reset, ends the session, unthrown.)
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

}  // namespace
