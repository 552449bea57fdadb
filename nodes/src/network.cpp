#include <dlfcn.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <algorithm>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/atom.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/io/middleman.hpp>
#include <caf/openssl/manager.hpp>
#include <caf/openssl/publish.hpp>
#include <caf/openssl/remote_actor.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <cstdio>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "troupe/bulk.hpp"
#include "troupe/error.hpp"
#include "troupe/messages.hpp"
#include "troupe/node.hpp"
#include "troupe/registry.hpp"

namespace troupe {
namespace detail {
namespace {

int passphrase_callback(char* buf, int size, int, void* user) {
  auto& pass = *static_cast<const std::string*>(user);
  if (pass.empty() || static_cast<int>(pass.size()) > size) return 0;  // never prompt
  std::copy(pass.begin(), pass.end(), buf);
  return static_cast<int>(pass.size());
}

}  // namespace
}  // namespace detail

void check_tls(const tls& t) {
  if (t.key.empty() || t.ca.empty())
    throw invalid_argument(
        "TLS needs a certificate, a key and a CA file (--tls-cert, --tls-key, "
        "--tls-ca)");
  auto open = [](const std::string& path) {
    auto f = std::fopen(path.c_str(), "r");
    if (f == nullptr) throw invalid_argument("TLS file '" + path + "' cannot be read");
    return std::unique_ptr<FILE, int (*)(FILE*)>{f, &std::fclose};
  };
  for (const auto* cert : {&t.cert, &t.ca}) {
    auto f = open(*cert);
    X509* x = PEM_read_X509(f.get(), nullptr, nullptr, nullptr);
    if (x == nullptr) throw invalid_argument("TLS file '" + *cert + "' is not a PEM certificate");
    X509_free(x);
  }
  auto f = open(t.key);
  EVP_PKEY* key = PEM_read_PrivateKey(f.get(), nullptr, &detail::passphrase_callback,
                                      const_cast<std::string*>(&t.passphrase));
  if (key == nullptr)
    throw invalid_argument("TLS key '" + t.key +
                           "' cannot be read: not a PEM key, or a wrong or missing passphrase");
  EVP_PKEY_free(key);
}

namespace detail {
namespace {

std::mutex tls_mutex;
std::map<std::string, tls>& remembered_tls() {
  static std::map<std::string, tls> instance;
  return instance;
}

}  // namespace

host_port parse_host_port(const std::string& spec) {
  auto colon = spec.rfind(':');
  auto bad = [&](const char* why) {
    return invalid_argument("malformed node address '" + spec + "': " + why +
                            " (expected HOST:PORT, e.g. 127.0.0.1:4242)");
  };
  if (colon == std::string::npos || colon == 0) throw bad("no host");
  auto port = spec.substr(colon + 1);
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), ::isdigit))
    throw bad("the port must be a number");
  auto value = std::stoul(port);
  if (value > 65535) throw bad("port out of range");
  return {spec.substr(0, colon), static_cast<std::uint16_t>(value)};
}

std::unique_ptr<caf::actor_system_config> make_system_config(bool network, const tls& t) {
  auto cfg = std::make_unique<caf::actor_system_config>();
  // Work sharing: a round trip to a detached actor costs ~13 us instead of ~60 us here.
  cfg->set("scheduler.policy", caf::atom("sharing"));
  cfg->set("scheduler.max-threads", 2);
  cfg->set("logger.file-verbosity", caf::atom("quiet"));
  cfg->set("logger.console-verbosity", caf::atom("quiet"));
  if (!network) return cfg;
  cfg->load<caf::io::middleman>();
  cfg->add_message_type<work_chunk>("troupe.work_chunk");
  cfg->add_message_type<chunk_result>("troupe.chunk_result");
  cfg->add_message_type<bulk::fragment>("troupe.bulk_fragment");
  cfg->add_message_type<init_done>("troupe.init_done");
  cfg->add_message_type<consume_ack>("troupe.consume_ack");
  cfg->add_message_type<node_hello>("troupe.node_hello");
  cfg->add_message_type<spawn_producer>("troupe.spawn_producer");
  // Messages are deserialized on the multiplexer thread itself: a BASP worker would first copy
  // every received payload (bulk fragments included) into a buffer of its own.
  cfg->set("middleman.workers", std::size_t{0});
  cfg->set("scheduler.max-throughput", std::size_t{1});
  // Heartbeats on both sides: a frozen peer is given up on after ~connection-timeout.
  cfg->set("middleman.heartbeat-interval", caf::timespan{std::chrono::milliseconds{200}});
  cfg->set("middleman.connection-timeout", caf::timespan{std::chrono::milliseconds{1500}});
  if (t.enabled()) {
    check_tls(t);
    cfg->load<caf::openssl::manager>();
    cfg->openssl_certificate = t.cert;
    cfg->openssl_key = t.key;
    cfg->openssl_passphrase = t.passphrase;
    cfg->openssl_cafile = t.ca;
  }
  return cfg;
}

caf::actor connect_node(caf::actor_system& sys, const std::string& address, const tls& t,
                        std::chrono::milliseconds deadline, std::vector<std::string>* devices) {
  auto hp = parse_host_port(address);
  auto fail = [&](const std::string& why) {
    return node_error("cannot use node " + address + ": " + why);
  };
  // CAF's connect has no deadline of its own: wait for it on a helper thread.
  auto result = std::make_shared<std::promise<caf::expected<caf::actor>>>();
  auto done = result->get_future();
  std::thread{[&sys, hp, secure = t.enabled(), result] {
    try {
      if (secure)
        result->set_value(caf::openssl::remote_actor<caf::actor>(sys, hp.host, hp.port));
      else
        result->set_value(sys.middleman().remote_actor(hp.host, hp.port));
    } catch (...) {
      result->set_exception(std::current_exception());
    }
  }}.detach();
  if (done.wait_for(deadline) != std::future_status::ready)
    throw node_error("cannot use node " + address + ": no answer within " +
                     std::to_string(deadline.count()) +
                     " ms (is it frozen, or does it expect TLS?)");
  caf::expected<caf::actor> handle{caf::error{}};
  try {
    handle = done.get();
  } catch (const std::exception& e) {
    throw fail(e.what());
  }
  if (!handle) throw fail(sys.render(handle.error()));
  caf::scoped_actor self{sys};
  std::string refused;
  self->request(*handle, deadline, hello_atom::value)
      .receive(
          [&](const node_hello& hello) {
            if (hello.version != node_protocol_version)
              refused = "it speaks protocol version " + std::to_string(hello.version) +
                        ", this program " + std::to_string(node_protocol_version);
            else if (devices != nullptr)
              *devices = hello.devices;
          },
          [&](const caf::error& err) {
            refused = "it did not answer the troupe handshake (" + sys.render(err) +
                      "); is it a troupe node?";
          });
  if (!refused.empty()) throw fail(refused);
  return *handle;
}

caf::actor_system& network_system(const tls& t) {
  static std::mutex mtx;
  static caf::actor_system* sys = nullptr;  // never destroyed: connections may outlive anything
  static tls settings;
  if (t.enabled()) check_tls(t);
  std::lock_guard<std::mutex> guard{mtx};
  if (sys == nullptr) {
    auto cfg = make_system_config(true, t).release();
    sys = new caf::actor_system(*cfg);
    settings = t;
  } else if (t.cert != settings.cert || t.key != settings.key || t.ca != settings.ca) {
    throw invalid_argument(
        "this process already uses the network with other TLS settings: one process, one TLS "
        "identity");
  }
  return *sys;
}

tls tls_for(const std::string& address) {
  std::lock_guard<std::mutex> guard{tls_mutex};
  auto i = remembered_tls().find(address);
  return i == remembered_tls().end() ? tls{} : i->second;
}

}  // namespace detail

// -- node ----------------------------------------------------------------------------------------

namespace {

struct node_state {
  std::vector<device> devices;
  std::map<caf::actor_addr, std::vector<caf::actor>> producers_of;  ///< by owner
};

std::string join(const std::vector<std::string>& xs) {
  std::string out;
  for (auto& x : xs) out += (out.empty() ? "" : ", ") + x;
  return out.empty() ? "none" : out;
}

caf::behavior node_actor(caf::event_based_actor* self, std::vector<device> devices) {
  auto st = std::make_shared<node_state>();
  st->devices = std::move(devices);
  // A coordinator that is gone (process killed, network cut) leaves no producer behind.
  self->set_down_handler([self, st](caf::down_msg& dm) {
    auto i = st->producers_of.find(dm.source);
    if (i == st->producers_of.end()) return;
    for (auto& p : i->second) self->send_exit(p, caf::exit_reason::user_shutdown);
    st->producers_of.erase(i);
  });
  self->attach_functor([st](const caf::error&) {
    for (auto& [owner, producers] : st->producers_of)
      for (auto& p : producers) caf::anon_send_exit(p, caf::exit_reason::user_shutdown);
    st->producers_of.clear();
  });
  return {
      [st](hello_atom) {
        node_hello hello{node_protocol_version, {}};
        for (auto& d : st->devices) hello.devices.push_back(d.str());
        return hello;
      },
      [self, st](spawn_producer& req, const caf::actor& owner) -> caf::result<caf::actor> {
        auto job = find_job(req.job);
        if (!job.spawn)
          return make_error(errc::node_error, "this node does not run job '" + req.job +
                                                  "' (it registers: " + join(registered_jobs()) +
                                                  ")");
        if (job.signature != req.signature)
          return make_error(errc::node_error,
                            "job '" + req.job + "' here takes " + job.signature +
                                ", the coordinator's takes " + req.signature +
                                ": build both programs from the same job definition");
        std::unique_ptr<device> d;
        try {
          d = std::make_unique<device>(req.device);
        } catch (const std::exception& e) {
          return make_error(errc::invalid_argument, e.what());
        }
        if (!d->is_local() ||
            std::find(st->devices.begin(), st->devices.end(), *d) == st->devices.end()) {
          std::vector<std::string> offered;
          for (auto& x : st->devices) offered.push_back(x.str());
          return make_error(errc::device_unavailable,
                            "this node offers " + join(offered) + ", not " + req.device);
        }
        auto p = job.spawn(self->system(), *d, req.cfg);
        auto& mine = st->producers_of[owner.address()];
        if (mine.empty()) self->monitor(owner);
        mine.push_back(p);
        return p;
      },
  };
}

}  // namespace

struct node::impl {
  caf::actor_system* sys = nullptr;
  caf::actor actor;
  std::string host;
  std::uint16_t port = 0;
};

node::node(std::unique_ptr<impl> p) : impl_(std::move(p)) {}
node::node(node&&) noexcept = default;
node& node::operator=(node&& other) noexcept {
  if (this != &other) {
    stop();
    impl_ = std::move(other.impl_);
  }
  return *this;
}
node::~node() {
  stop();
}

node node::serve(const std::string& host_port, std::vector<device> devices, tls t) {
  auto hp = detail::parse_host_port(host_port);
  if (devices.empty()) throw invalid_argument("a node needs at least one device to offer");
  for (auto& d : devices) {
    if (!d.is_local()) throw invalid_argument("a node offers its own devices, not " + d.str());
    if (auto why = why_unavailable(d); !why.empty()) throw device_unavailable(why);
  }
  auto p = std::make_unique<impl>();
  p->sys = &detail::network_system(t);
  p->actor = p->sys->spawn(node_actor, std::move(devices));
  p->host = hp.host;
  auto port = t.enabled() ? caf::openssl::publish(p->actor, hp.port, hp.host.c_str(), true)
                          : p->sys->middleman().publish(p->actor, hp.port, hp.host.c_str(), true);
  if (!port) {
    auto why = p->sys->render(port.error());
    caf::anon_send_exit(p->actor, caf::exit_reason::user_shutdown);
    p->actor = nullptr;
    throw node_error("cannot serve on " + host_port + ": " + why);
  }
  p->port = *port;
  return node{std::move(p)};
}

std::uint16_t node::port() const {
  return impl_ ? impl_->port : 0;
}

std::string node::address() const {
  return impl_ ? impl_->host + ":" + std::to_string(impl_->port) : std::string{};
}

void node::stop() {
  if (!impl_) return;
  if (impl_->actor) {
    // Unpublish first: a published port outlives its actor and would hand out a dead one.
    impl_->sys->middleman().unpublish(impl_->actor, impl_->port);
    caf::anon_send_exit(impl_->actor, caf::exit_reason::user_shutdown);
    impl_->actor = nullptr;
  }
  impl_.reset();
}

// -- cluster -------------------------------------------------------------------------------------

cluster cluster::connect(const std::vector<std::string>& nodes, tls t,
                         std::chrono::milliseconds deadline) {
  if (nodes.empty()) throw invalid_argument("cluster::connect needs at least one HOST:PORT");
  cluster c;
  auto& sys = detail::network_system(t);
  for (auto& address : nodes) {
    std::vector<std::string> offered;
    detail::connect_node(sys, address, t, deadline, &offered);
    c.nodes_.push_back(address);
    for (auto& d : offered) c.devices_.emplace_back(address + "/" + d);
  }
  std::lock_guard<std::mutex> guard{detail::tls_mutex};
  for (auto& address : nodes) detail::remembered_tls()[address] = t;
  return c;
}

}  // namespace troupe

// -- a workaround for CAF 0.17.6's OpenSSL module ------------------------------------------------
//
// OpenSSL's error queue is per thread and must be empty before each TLS I/O call, or
// SSL_get_error() misreads an ordinary "would block" as a fatal error. CAF 0.17.6 never clears
// it, and runs every TLS connection of a process on its one multiplexer thread: a peer failing
// its handshake left errors behind, and the next read on any other connection (a coordinator's,
// mid-run) then dropped that connection. These definitions come first in symbol lookup (they are
// in the program, and libcaf_openssl refers to them), clear the queue, and call OpenSSL's own.
// Tested by NodesTls.PeersRefusedDuringARunLeaveItUndisturbed.
namespace {
template <class Fn>
Fn openssl_function(const char* name) {
  auto* f = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
  if (f == nullptr) {
    std::fprintf(stderr, "troupe: cannot find OpenSSL's %s: %s\n", name, dlerror());
    std::abort();
  }
  return f;
}
}  // namespace

extern "C" {

int SSL_read(SSL* ssl, void* buf, int num) {
  static auto real = openssl_function<int (*)(SSL*, void*, int)>("SSL_read");
  ERR_clear_error();
  return real(ssl, buf, num);
}

int SSL_write(SSL* ssl, const void* buf, int num) {
  static auto real = openssl_function<int (*)(SSL*, const void*, int)>("SSL_write");
  ERR_clear_error();
  return real(ssl, buf, num);
}

int SSL_accept(SSL* ssl) {
  static auto real = openssl_function<int (*)(SSL*)>("SSL_accept");
  ERR_clear_error();
  return real(ssl);
}

int SSL_connect(SSL* ssl) {
  static auto real = openssl_function<int (*)(SSL*)>("SSL_connect");
  ERR_clear_error();
  return real(ssl);
}

}  // extern "C"
