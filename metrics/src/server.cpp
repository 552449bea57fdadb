// serve_metrics (metrics.hpp): /metrics, /status.json and the live page over Boost.Beast
// (Debian's libboost1.81-dev, header-only), on one thread of its own. Event-driven: a client that
// connects and says nothing, or sends half a request and stops, costs a socket and a small
// buffer until its 5 s are up, never a thread, so it cannot hold a scrape up (a server with a
// thread per connection, as cpp-httplib's, answered nobody while 8 such clients waited;
// MetricsHostile.ScrapesAreAnsweredWhileManyIdleConnectionsAreHeld).
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "metrics_parts.hpp"
#include "troupe/error.hpp"
#include "troupe/metrics.hpp"

namespace troupe {

namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

constexpr std::chrono::seconds client_time{5};  ///< to send a request, or to take an answer
constexpr std::size_t max_connections = 256;    ///< beyond: the oldest silent one is closed
constexpr std::size_t max_header = 16 * 1024;   ///< GETs only: nothing big is ever accepted

class session;

/// The clients (on the server's thread only): how many, and those waiting for a request, oldest
/// first: at max_connections the oldest of those is closed to make room for a new one (so that
/// silent clients cannot lock a scraper out).
struct clients {
  std::size_t open = 0;
  std::list<std::weak_ptr<session>> waiting;
};

/// One client: requests read and answered in turn (keep-alive), each within client_time.
class session : public std::enable_shared_from_this<session> {
 public:
  session(tcp::socket s, std::shared_ptr<clients> all)
      : stream_(std::move(s)), all_(std::move(all)) {
    all_->open += 1;
  }
  ~session() {
    unlist();
    all_->open -= 1;
  }
  session(const session&) = delete;
  session& operator=(const session&) = delete;

  void read() {
    parser_.emplace();
    parser_->header_limit(max_header);
    parser_->body_limit(0);
    stream_.expires_after(client_time);
    listed_ = all_->waiting.insert(all_->waiting.end(), weak_from_this());
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, std::size_t) {
                       self->unlist();
                       if (!ec) self->answer();
                     });
  }
  /// Made room for a newer client.
  void evict() {
    unlist();
    stream_.close();
  }

 private:
  void unlist() {
    if (listed_) all_->waiting.erase(*listed_);
    listed_.reset();
  }
  void answer() {
    auto req = parser_->release();
    auto res = std::make_shared<http::response<http::string_body>>(http::status::ok, req.version());
    res->set(http::field::server, "troupe");
    res->keep_alive(req.keep_alive());
    auto target = req.target();  // the path: a query string ("/metrics?x=1") is ignored
    if (auto q = target.find('?'); q != beast::string_view::npos) target = target.substr(0, q);
    if (req.method() != http::verb::get && req.method() != http::verb::head) {
      res->result(http::status::method_not_allowed);
      res->set(http::field::content_type, "text/plain");
      res->body() = "GET only\n";
    } else if (target == "/metrics") {
      res->set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
      res->body() = metrics_text();
    } else if (target == "/status.json") {
      res->set(http::field::content_type, "application/json");
      res->set(http::field::cache_control, "no-store");
      res->body() = status_json();
    } else if (target == "/") {
      res->set(http::field::content_type, "text/html; charset=utf-8");
      res->body() = detail::status_page();
    } else {
      res->result(http::status::not_found);
      res->set(http::field::content_type, "text/plain");
      res->body() = "not found\n";
    }
    res->prepare_payload();
    if (req.method() == http::verb::head) res->body().clear();
    stream_.expires_after(client_time);
    http::async_write(stream_, *res,
                      [self = shared_from_this(), res](beast::error_code ec, std::size_t) {
                        if (ec) return;
                        if (res->keep_alive()) return self->read();
                        beast::error_code ignored;
                        self->stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
                      });
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_{max_header};
  std::optional<http::request_parser<http::empty_body>> parser_;
  std::shared_ptr<clients> all_;
  std::optional<std::list<std::weak_ptr<session>>::iterator> listed_;
};

void accept(tcp::acceptor& acceptor, const std::shared_ptr<clients>& all) {
  acceptor.async_accept([&acceptor, all](beast::error_code ec, tcp::socket s) {
    if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
    if (ec) {
      // Out of descriptors, say: accepting again at once would fail at once, in a busy loop.
      auto pause = std::make_shared<net::steady_timer>(acceptor.get_executor(),
                                                       std::chrono::milliseconds{10});
      pause->async_wait([&acceptor, all, pause](beast::error_code e) {
        if (!e) accept(acceptor, all);
      });
      return;
    }
    if (all->open >= max_connections && !all->waiting.empty()) {
      if (auto oldest = all->waiting.front().lock()) oldest->evict();
    }
    if (all->open < 2 * max_connections)  // (evicted ones end in a moment)
      std::make_shared<session>(std::move(s), all)->read();
    accept(acceptor, all);
  });
}

}  // namespace

struct metrics_server::impl {
  net::io_context io{1};
  tcp::acceptor acceptor{io};
  std::shared_ptr<clients> all = std::make_shared<clients>();
  std::thread thread;
  std::string host;
  int port = 0;
  ~impl() {
    io.stop();
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
  auto host = i->host;
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  beast::error_code ec;
  tcp::resolver resolver{i->io};
  auto at = resolver.resolve(host, std::to_string(port), ec);
  if (ec || at.empty())
    throw invalid_argument("serve_metrics(\"" + host_port + "\"): cannot resolve the host (" +
                           ec.message() + ")");
  tcp::endpoint where = *at.begin();
  auto& a = i->acceptor;
  a.open(where.protocol(), ec);
  // TIME_WAIT sockets of an earlier server do not count; a listener does (Linux).
  if (!ec) a.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) a.bind(where, ec);
  if (!ec) a.listen(net::socket_base::max_listen_connections, ec);
  if (ec)
    throw invalid_argument("serve_metrics(\"" + host_port + "\"): cannot listen there (" +
                           ec.message() + ")");
  i->port = a.local_endpoint().port();
  accept(a, i->all);
  i->thread = std::thread([io = &i->io] {
    for (;;) {
      try {
        io->run();
        return;
      } catch (const std::exception&) {
        // a handler that threw (metrics_text() out of memory, say): that client is gone
      }
    }
  });
  return metrics_server{std::move(i)};
}

}  // namespace troupe
