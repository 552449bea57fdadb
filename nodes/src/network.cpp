#include "troupe/detail/network.hpp"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/atom.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/io/middleman.hpp>
#include <caf/openssl/manager.hpp>
#include <caf/openssl/publish.hpp>
#include <caf/openssl/remote_actor.hpp>
#include <caf/openssl/session.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <cerrno>
#include <cstdio>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "troupe/device_binding.hpp"
#include "troupe/error.hpp"
#include "troupe/internal/bulk.hpp"
#include "troupe/internal/registry.hpp"
#include "troupe/log.hpp"
#include "troupe/node.hpp"
#include "troupe/protocol.hpp"

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

void keep_openssl_until_exit() {
  // OpenSSL frees its global state from an atexit() handler (OPENSSL_cleanup) unless told
  // otherwise by the first initialization. The network's actor system is never destroyed: its
  // multiplexer thread may still be reading or closing a TLS connection while exit() runs the
  // handler, and then touches freed tables (a SIGSEGV after main returned, seen in CI when a
  // node closed its connection as a test process exited). The process's memory goes at exit
  // anyway. A program that initialized OpenSSL itself before troupe keeps OpenSSL's default.
  static std::once_flag once;
  std::call_once(once, [] {
    OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr);
    OPENSSL_init_ssl(0, nullptr);
  });
}

}  // namespace detail

void check_tls(const tls& t) {
  detail::keep_openssl_until_exit();
  if (t.key.empty() || t.ca.empty())
    throw invalid_argument(
        "TLS needs a certificate, a key and a CA file (--tls-cert, --tls-key, "
        "--tls-ca)");
  auto open = [](const std::string& path) {
    auto f = std::fopen(path.c_str(), "r");
    if (f == nullptr) throw invalid_argument("TLS file '" + path + "' cannot be read");
    return std::unique_ptr<FILE, int (*)(FILE*)>{f, &std::fclose};
  };
  using x509_ptr = std::unique_ptr<X509, void (*)(X509*)>;
  auto read_cert = [&](const std::string& path) {
    auto f = open(path);
    x509_ptr x{PEM_read_X509(f.get(), nullptr, nullptr, nullptr), &X509_free};
    if (!x) throw invalid_argument("TLS file '" + path + "' is not a PEM certificate");
    return x;
  };
  auto cert = read_cert(t.cert);
  read_cert(t.ca);
  auto f = open(t.key);
  std::unique_ptr<EVP_PKEY, void (*)(EVP_PKEY*)> key{
      PEM_read_PrivateKey(f.get(), nullptr, &detail::passphrase_callback,
                          const_cast<std::string*>(&t.passphrase)),
      &EVP_PKEY_free};
  if (!key)
    throw invalid_argument("TLS key '" + t.key +
                           "' cannot be read: not a PEM key, or a wrong or missing passphrase");
  // CAF would load a mismatched pair and fail only on the first connection (with an abort).
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    throw invalid_argument("TLS key '" + t.key + "' does not belong to the certificate '" + t.cert +
                           "'");
  }
  ERR_clear_error();
}

// -- limits --------------------------------------------------------------------------------------

namespace {

std::mutex limits_mutex;
limits current_limits;
bool network_started = false;  ///< the network system exists: limits are fixed

bool same(const limits& a, const limits& b) {
  return a.max_message_bytes == b.max_message_bytes && a.handshake_timeout == b.handshake_timeout &&
         a.idle_timeout == b.idle_timeout && a.max_connections == b.max_connections &&
         a.max_producers_per_coordinator == b.max_producers_per_coordinator &&
         a.heartbeat == b.heartbeat;
}

}  // namespace

void set_network_limits(const limits& l) {
  if (l.max_message_bytes == 0 || l.handshake_timeout.count() <= 0 || l.idle_timeout.count() <= 0 ||
      l.max_connections == 0 || l.max_producers_per_coordinator == 0 || l.heartbeat.count() <= 0)
    throw invalid_argument("network limits must all be positive");
  constexpr auto day = std::chrono::hours{24};  // beyond it, 2 x heartbeat could overflow
  if (l.handshake_timeout > day || l.idle_timeout > day || l.heartbeat > day)
    throw invalid_argument("network limits: no duration may be longer than a day");
  if (l.idle_timeout < std::chrono::milliseconds{500})
    throw invalid_argument("idle_timeout must be at least 500 ms");
  if (l.idle_timeout < 2 * l.heartbeat)
    throw invalid_argument("idle_timeout must be at least twice the heartbeat (" +
                           std::to_string(l.heartbeat.count()) + " ms)");
  if (l.max_message_bytes > 0xFFFF'FFFFu)  // BASP's length field: 32 bits
    throw invalid_argument("max_message_bytes must be under 4 GiB (BASP's 32-bit length)");
  if (l.max_connections > 1'000'000)
    throw invalid_argument("max_connections must be at most 1,000,000");
  if (l.max_message_bytes < (std::size_t{2} << 20))
    throw invalid_argument(
        "max_message_bytes must be at least 2 MiB (troupe's bulk fragments are 1 MiB)");
  std::lock_guard<std::mutex> guard{limits_mutex};
  if (network_started && !same(l, current_limits))
    throw invalid_argument(
        "the network limits are fixed once this process uses the network: set them first");
  current_limits = l;
}

limits network_limits() {
  std::lock_guard<std::mutex> guard{limits_mutex};
  return current_limits;
}

namespace detail {
namespace {

std::mutex tls_mutex;
std::map<std::string, tls>& remembered_tls() {
  static auto& instance = *new std::map<std::string, tls>;  // never destroyed: see below
  return instance;
}

}  // namespace

host_port parse_host_port(const std::string& spec) {
  auto colon = spec.rfind(':');
  auto bad = [&](const char* why) {
    return invalid_argument("malformed node address '" + spec + "': " + why +
                            " (expected HOST:PORT, e.g. 127.0.0.1:4242)");
  };
  if (colon == std::string::npos) throw bad("the port is missing");
  if (colon == 0) throw bad("no host");
  auto port = spec.substr(colon + 1);
  if (port.empty()) throw bad("the port is missing");
  if (port.size() > 5 || !std::all_of(port.begin(), port.end(), ::isdigit))
    throw bad("the port must be a number");
  auto value = std::stoul(port);
  if (value > 65535) throw bad("port out of range");
  return {spec.substr(0, colon), static_cast<std::uint16_t>(value)};
}

namespace {
std::atomic<std::size_t> own_threads{0};      ///< set_threads(n), 0: one per core
std::atomic<bool> own_system_started{false};  ///< make_system_config has run
}  // namespace

void add_message_types(caf::actor_system_config& cfg) {
  cfg.add_message_type<work_chunk>("troupe.work_chunk");
  cfg.add_message_type<chunk_result>("troupe.chunk_result");
  cfg.add_message_type<bulk::fragment>("troupe.bulk_fragment");
  cfg.add_message_type<init_done>("troupe.init_done");
  cfg.add_message_type<consume_ack>("troupe.consume_ack");
  cfg.add_message_type<node_hello>("troupe.node_hello");
  cfg.add_message_type<spawn_producer>("troupe.spawn_producer");
  cfg.add_message_type<ring_order>("troupe.ring_order");
}

}  // namespace detail

void set_threads(std::size_t n) {
  if (n == 0) throw invalid_argument("set_threads(0): troupe's actor system needs a thread");
  if (n > 4096)  // CAF parses the setting as a signed number; thousands of threads fail to start
    throw invalid_argument("set_threads(" + std::to_string(n) + "): at most 4096");
  if (detail::own_system_started.load() && n != detail::own_threads.load())
    throw invalid_argument(
        "set_threads() after troupe's actor system started (the first runner, node or "
        "data_parallel of this process): call it before");
  detail::own_threads = n;
}

void add_to(caf::actor_system_config& cfg) {
  cfg.load<caf::io::middleman>();
  detail::add_message_types(cfg);
}

namespace detail {

std::unique_ptr<caf::actor_system_config> make_system_config(bool network, const tls& t) {
  own_system_started = true;
  auto cfg = std::make_unique<caf::actor_system_config>();
  // Work sharing: a round trip to a detached actor costs ~13 us instead of ~60 us here.
  cfg->set("scheduler.policy", caf::atom("sharing"));
  // These threads run the jobs' consumers (and nothing that must stay responsive: the
  // scheduler and the producers have threads of their own): one per core. More threads than
  // cores cost the throughput of cheap items (x*x: ~250 instead of ~500 M items/s on 2 cores).
  cfg->set("scheduler.max-threads", own_threads.load()
                                        ? own_threads.load()
                                        : static_cast<std::size_t>(std::max(2, usable_cores())));
  cfg->set("logger.file-verbosity", caf::atom("quiet"));
  cfg->set("logger.console-verbosity", caf::atom("quiet"));
  if (!network) return cfg;
  cfg->load<caf::io::middleman>();
  add_message_types(*cfg);
  // Messages are deserialized on the multiplexer thread itself: a BASP worker would first copy
  // every received payload (bulk fragments included) into a buffer of its own.
  cfg->set("middleman.workers", std::size_t{0});
  cfg->set("scheduler.max-throughput", std::size_t{1});
  // Heartbeats on both sides: a frozen peer is given up on after ~connection-timeout.
  auto l = network_limits();
  cfg->set("middleman.heartbeat-interval", caf::timespan{l.heartbeat});
  cfg->set("middleman.connection-timeout", caf::timespan{l.idle_timeout});
#ifdef TROUPE_CAF_PATCHED
  // Enforced by troupe's CAF patches (third_party/caf/patches), unknown to an unpatched CAF.
  cfg->set("middleman.max-payload-size", l.max_message_bytes);
  cfg->set("middleman.max-handshake-size", std::size_t{64} << 10);
  cfg->set("middleman.handshake-timeout", caf::timespan{l.handshake_timeout});
  cfg->set("middleman.max-connections", l.max_connections);
#endif
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

namespace {

/// What an OpenSSL reason means for a troupe user (empty when nothing more can be said).
std::string tls_cause(const std::string& reason) {
  auto has = [&](const char* x) { return reason.find(x) != std::string::npos; };
  if (has("alert unknown ca") || has("alert bad certificate") || has("alert decrypt error"))
    return ": the node does not accept this process's certificate (not signed by its CA)";
  if (has("certificate required") || has("peer did not return a certificate"))
    return ": the node requires a client certificate";
  if (has("certificate verify failed"))
    return ": the node's certificate is not signed by this process's CA";
  if (has("wrong version number") || has("packet length too long") || has("http request"))
    return ": the node does not speak TLS";
  return {};
}

}  // namespace

caf::actor connect_node(caf::actor_system& sys, const std::string& address, const tls& t,
                        std::chrono::milliseconds deadline, std::vector<std::string>* devices,
                        std::uint64_t* incarnation, bool* leaving,
                        const std::function<bool()>& cancelled) {
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
  // One deadline for the whole connect (CAF's handshake, then troupe's): a node that answers
  // slowly is a node_error naming it, never a hang. (CAF itself gives up on a connection
  // without a completed handshake after limits::handshake_timeout, which ends the helper.)
  auto give_up = std::chrono::steady_clock::now() + deadline;
  auto slice = cancelled ? std::chrono::milliseconds{50} : deadline;
  for (auto now = std::chrono::steady_clock::now(); now < give_up;
       now = std::chrono::steady_clock::now()) {
    if (done.wait_until(std::min(give_up, now + slice)) == std::future_status::ready) break;
    if (cancelled && cancelled())
      throw node_error("cannot use node " + address + ": the attempt was given up (closing)");
  }
  if (done.wait_for(std::chrono::seconds{0}) != std::future_status::ready)
    throw node_error("cannot use node " + address + ": no answer within " +
                     std::to_string(deadline.count()) +
                     " ms (is it frozen or overloaded, or does it expect TLS?)");
  caf::expected<caf::actor> handle{caf::error{}};
  try {
    handle = done.get();
  } catch (const std::exception& e) {
    throw fail(e.what());
  }
  if (!handle) {
    auto why = sys.render(handle.error());
    if (handle.error() == caf::sec::disconnect_during_handshake) {
#ifdef TROUPE_CAF_PATCHED
      auto tls_error = t.enabled() ? caf::openssl::last_tls_error() : std::string{};
#else
      std::string tls_error;
#endif
      if (!tls_error.empty())
        why += " (TLS: " + tls_error + tls_cause(tls_error) + ")";
      else if (t.enabled())
        why +=
            " (the node closed the connection during the TLS handshake: it refused this "
            "process's certificate, or does not use TLS)";
      else
        why += " (the node closed the connection during the handshake: does it expect TLS?)";
    } else if (handle.error() == caf::sec::connection_timeout) {
      why += " (the node did not complete the handshake in time)";
    } else if (handle.error() == caf::sec::malformed_basp_message) {
      why += " (the peer does not speak CAF's protocol correctly: is it a troupe node?)";
    }
    throw fail(why);
  }
  caf::scoped_actor self{sys};
  std::string refused;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      give_up - std::chrono::steady_clock::now());
  self->request(*handle, std::max(left, std::chrono::milliseconds{1}), hello_atom::value)
      .receive(
          [&](const node_hello& hello) {
            if (hello.version != node_protocol_version)
              refused = "it speaks protocol version " + std::to_string(hello.version) +
                        ", this program " + std::to_string(node_protocol_version);
            else {
              if (devices != nullptr) *devices = hello.devices;
              if (incarnation != nullptr) *incarnation = hello.incarnation;
              if (leaving != nullptr) *leaving = hello.leaving;
            }
          },
          [&](const caf::error& err) {
            refused = "it did not answer the troupe handshake (" + sys.render(err) +
                      "); is it a troupe node?";
          });
  if (!refused.empty()) throw fail(refused);
  return *handle;
}

caf::actor_system& network_system(const tls& t) {
  keep_openssl_until_exit();  // before CAF's openssl module (or anything else) initializes it
  static std::mutex mtx;
  // Never destroyed, nor is anything its threads may read (the registries of jobs and batch
  // types, the TLS settings): connections and actors may outlive anything, exit() included.
  static caf::actor_system* sys = nullptr;
  static auto& settings = *new tls;
  if (t.enabled()) check_tls(t);
  std::lock_guard<std::mutex> guard{mtx};
  if (sys == nullptr) {
    {
      std::lock_guard<std::mutex> limits_guard{limits_mutex};
      network_started = true;
    }
    // Room for max_connections sockets besides everything else the process has open (the
    // soft limit is often 1,024 while the hard one is far higher).
    rlimit files{};
    if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
      files.rlim_cur = files.rlim_max;
      setrlimit(RLIMIT_NOFILE, &files);
    }
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

namespace {
std::mutex serve_host_mutex;
std::string& served_plain_host = *new std::string;  // never destroyed: see network_system()
}  // namespace

void note_plain_serve_host(const std::string& host) {
  std::lock_guard<std::mutex> guard{serve_host_mutex};
  served_plain_host = host;
}

std::string plain_serve_host() {
  std::lock_guard<std::mutex> guard{serve_host_mutex};
  return served_plain_host;
}

tls tls_for(const std::string& address) {
  std::lock_guard<std::mutex> guard{tls_mutex};
  auto i = remembered_tls().find(address);
  return i == remembered_tls().end() ? tls{} : i->second;
}

std::uint64_t new_incarnation() {
  static std::mutex mtx;
  static std::mt19937_64 gen{[] {
    std::random_device rd;
    std::seed_seq seq{
        rd(),
        rd(),
        rd(),
        rd(),
        static_cast<unsigned>(::getpid()),
        static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count())};
    return std::mt19937_64{seq};
  }()};
  std::lock_guard<std::mutex> guard{mtx};
  std::uint64_t x = 0;
  while (x == 0) x = gen();
  return x;
}

void remember_tls(const std::string& address, const tls& t) {
  std::lock_guard<std::mutex> guard{tls_mutex};
  remembered_tls()[address] = t;
}

}  // namespace detail
}  // namespace troupe
