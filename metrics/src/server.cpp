// serve_metrics (metrics.hpp): /metrics, /status.json and the live page over cpp-httplib
// (Debian's libcpp-httplib-dev), on a thread of its own.
#include <httplib.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "metrics_parts.hpp"
#include "troupe/error.hpp"
#include "troupe/metrics.hpp"

namespace troupe {

namespace {

/// Whether a socket without SO_REUSEPORT can bind host:port (IPv4 or IPv6 literal, or a name).
bool port_free(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res)
    return true;  // httplib's own bind reports a bad host
  bool ok = true;
  int fd = ::socket(res->ai_family, res->ai_socktype, res->ai_protocol);
  if (fd >= 0) {
    int yes = 1;  // TIME_WAIT sockets of an earlier server do not count; a listener does
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    ok = ::bind(fd, res->ai_addr, res->ai_addrlen) == 0 || errno != EADDRINUSE;
    ::close(fd);
  }
  freeaddrinfo(res);
  return ok;
}

}  // namespace

struct metrics_server::impl {
  httplib::Server server;
  std::thread thread;
  std::string host;
  int port = 0;
  ~impl() {
    server.stop();
    if (thread.joinable()) thread.join();
  }
};

metrics_server::metrics_server(std::unique_ptr<impl> i) : impl_(std::move(i)) {}
metrics_server::metrics_server(metrics_server&&) noexcept = default;
metrics_server& metrics_server::operator=(metrics_server&&) noexcept = default;
metrics_server::~metrics_server() = default;

std::string metrics_server::address() const {
  return impl_ ? impl_->host + ":" + std::to_string(impl_->port) : std::string{};
}

metrics_server serve_metrics(const std::string& host_port) {
  auto colon = host_port.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == host_port.size() ||
      host_port.find_first_not_of("0123456789", colon + 1) != std::string::npos ||
      host_port.size() - colon - 1 > 5)
    throw invalid_argument("serve_metrics(\"" + host_port + "\"): expected HOST:PORT");
  auto port = std::stoi(host_port.substr(colon + 1));
  if (port > 65535)
    throw invalid_argument("serve_metrics(\"" + host_port + "\"): the port is over 65535");
  auto i = std::make_unique<metrics_server::impl>();
  i->host = host_port.substr(0, colon);
  auto& svr = i->server;
  svr.Get("/metrics", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(), "text/plain; version=0.0.4; charset=utf-8");
  });
  svr.Get("/status.json", [](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-store");
    res.set_content(status_json(), "application/json");
  });
  svr.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(detail::status_page(), "text/html; charset=utf-8");
  });
  // Bounded: a scraper or a browser that holds its connection open is dropped after 5 s idle.
  svr.set_keep_alive_timeout(5);
  svr.set_read_timeout(5, 0);
  svr.set_write_timeout(5, 0);
  svr.set_payload_max_length(64 * 1024);  // GETs only: nothing big is ever accepted
  // cpp-httplib binds with SO_REUSEPORT: a second server on a taken port would share it
  // silently. A plain bind first says whether the port is free.
  if (port != 0 && !port_free(i->host, port))
    throw invalid_argument("serve_metrics(\"" + host_port + "\"): the port is taken");
  i->port =
      port == 0 ? svr.bind_to_any_port(i->host) : (svr.bind_to_port(i->host, port) ? port : -1);
  if (i->port <= 0)
    throw invalid_argument("serve_metrics(\"" + host_port +
                           "\"): cannot listen there (a bad "
                           "host, or the port is taken)");
  i->thread = std::thread([s = &svr] { s->listen_after_bind(); });
  // Until it runs, a stop() would be lost (and the destructor's join would wait forever).
  while (!svr.is_running()) std::this_thread::sleep_for(std::chrono::microseconds{100});
  return metrics_server{std::move(i)};
}

}  // namespace troupe
