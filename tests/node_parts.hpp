// The helpers of the node tests (node_*_test.cpp): node processes of the test node program,
// and the raw BASP speakers of the hostile-peer tests. The jobs are registered in node_test.cpp.
#pragma once

#include <arpa/inet.h>
#include <ftw.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <caf/actor_system.hpp>
#include <caf/binary_deserializer.hpp>
#include <caf/binary_serializer.hpp>
#include <caf/io/basp/header.hpp>
#include <caf/node_id.hpp>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <troupe/detail/network.hpp>
#include <troupe/internal/bulk.hpp>
#include <troupe/internal/registry.hpp>
#include <troupe/node.hpp>
#include <troupe/protocol.hpp>

#include "node_process.hpp"
#include "remote_jobs.hpp"
#include "test_util.hpp"
#include "wire_attack.hpp"

using test_util::iota;
using test_util::sum_of_squares;

namespace {

/// One troupe_test_node process, ended (SIGKILL) by the destructor.
class node_process : public test_util::node_process {
 public:
  explicit node_process(const std::string& devices, std::vector<std::string> extra = {})
      : test_util::node_process(TROUPE_TEST_NODE, devices, std::move(extra)) {}
};

inline troupe::config slow(std::int64_t us) {
  troupe::config cfg;
  cfg.set("sleep_us", us);
  return cfg;
}

/// Sends `sig` to `node` once the runner's producers have finished `items` items.
inline void signal_after(const node_process& node, troupe::options& opts, int sig,
                         std::uint64_t items) {
  auto sent = std::make_shared<std::atomic<bool>>(false);
  opts.on_progress = [&node, sig, items, sent](const troupe::progress& p) {
    if (p.done >= items && !sent->exchange(true)) node.kill(sig);
  };
}

}  // namespace

namespace {

namespace basp = caf::io::basp;
using namespace wire_attack;  // NOLINT: the attacks' tools

/// A 32-byte BASP header as CAF writes it.
inline std::string basp_header(basp::message_type op, std::uint8_t flags, std::uint32_t payload_len,
                               std::uint64_t operation_data, std::uint64_t source,
                               std::uint64_t dest) {
  basp::header hdr{op, flags, payload_len, operation_data, source, dest};
  std::vector<char> buf;
  caf::binary_serializer sink{nullptr, buf};
  if (auto err = sink(hdr)) throw std::runtime_error("cannot serialize a BASP header");
  if (buf.size() != basp::header_size) throw std::runtime_error("unexpected BASP header size");
  return {buf.begin(), buf.end()};
}

/// Reads exactly n bytes (or throws after `limit`).
inline std::string read_exactly(int fd, std::size_t n, std::chrono::milliseconds limit) {
  std::string out;
  auto until = std::chrono::steady_clock::now() + limit;
  char buf[65536];
  while (out.size() < n) {
    if (std::chrono::steady_clock::now() > until) throw std::runtime_error("read timed out");
    auto n_read = ::recv(fd, buf, std::min(sizeof buf, n - out.size()), 0);
    if (n_read == 0) throw std::runtime_error("connection closed");
    if (n_read > 0) out.append(buf, static_cast<std::size_t>(n_read));
  }
  return out;
}

/// utime + stime of a process, in clock ticks.
inline long cpu_ticks(pid_t pid) {
  std::ifstream in{"/proc/" + std::to_string(pid) + "/stat"};
  std::string stat{std::istreambuf_iterator<char>{in}, {}};
  std::istringstream fields{stat.substr(stat.rfind(')') + 2)};
  std::string x;
  long utime = 0, stime = 0;
  for (int i = 3; i <= 15; ++i) {  // fields 3 .. 15 of proc(5)
    fields >> x;
    if (i == 14) utime = std::stol(x);
    if (i == 15) stime = std::stol(x);
  }
  return utime + stime;
}

/// The node serves a coordinator (this process) exactly.
inline void expect_serves(const std::string& address, const troupe::tls& t = {}) {
  auto c = troupe::cluster::connect({address}, t);
  troupe::unordered_runner<remote_squares> runner{c.devices()};
  EXPECT_EQ(runner.run(iota(300)), sum_of_squares(300)) << address;
}

/// CAF's serialization of `xs` (as this process's network system writes it).
template <class... Ts>
inline std::string serialized(caf::actor_system& sys, Ts&&... xs) {
  std::vector<char> out;
  caf::binary_serializer sink{sys, out};
  if (auto err = sink(std::forward<Ts>(xs)...))
    throw std::runtime_error("serialize: " + sys.render(err));
  return {out.begin(), out.end()};
}

/// A made-up node id.
inline caf::node_id fake_node_id(std::uint32_t pid, char fill) {
  caf::node_id::default_data::host_id_type host;
  host.fill(static_cast<std::uint8_t>(fill));
  return caf::make_node_id(pid, host);
}

/// Completes CAF's handshake on `fd` (connected to a node) as node `me`; returns the actor
/// the node publishes (its node actor).
inline caf::actor_id basp_handshake_as(int fd, caf::actor_system& sys, const caf::node_id& me) {
  // The node's server handshake: its node id, app ids, the published actor, its interface.
  auto hdr = read_exactly(fd, basp::header_size, std::chrono::seconds{5});
  auto payload = read_exactly(fd, payload_len_at(hdr, 0), std::chrono::seconds{5});
  std::vector<char> buf(payload.begin(), payload.end());
  caf::binary_deserializer source{sys, buf};
  caf::node_id node_id;
  std::vector<std::string> app_ids;
  caf::actor_id node_actor = 0;
  std::set<std::string> ifaces;
  if (source(node_id, app_ids, node_actor, ifaces) || node_actor == 0)
    throw std::runtime_error("unexpected server handshake");
  auto hello = serialized(sys, me);
  if (!send_all(fd, basp_header(basp::message_type::client_handshake, 0,
                                static_cast<std::uint32_t>(hello.size()), 0, 0, 0) +
                        hello))
    throw std::runtime_error("cannot send the client handshake");
  return node_actor;
}

/// A request (direct message) from actor `source` to actor `dest` with message id `id`.
inline std::string basp_request(std::uint64_t id, caf::actor_id source, caf::actor_id dest,
                                const std::string& payload) {
  return basp_header(basp::message_type::direct_message, 0,
                     static_cast<std::uint32_t>(payload.size()),
                     caf::make_message_id(id).integer_value(), source, dest) +
         payload;
}

}  // namespace
