// Tools of the wire attacks (tests/node_test.cpp, tests/train_test.cpp): raw sockets, a relay
// that records what a real coordinator sends a node, the BASP frames of such a capture and
// mutations of them (bit flips, rewritten and huge length fields, truncations, duplicated,
// dropped and swapped messages, noise).
#pragma once

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <caf/actor_system.hpp>
#include <caf/binary_serializer.hpp>
#include <caf/io/basp/header.hpp>
#include <caf/node_id.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace wire_attack {

namespace basp = caf::io::basp;

/// The payload length of the header at `at`.
inline std::uint32_t payload_len_at(const std::string& bytes, std::size_t at) {
  std::uint32_t len = 0;
  for (std::size_t i = 4; i < 8; ++i) len = (len << 8) | static_cast<unsigned char>(bytes[at + i]);
  return len;
}

inline void set_payload_len_at(std::string& bytes, std::size_t at, std::uint32_t len) {
  for (std::size_t i = 0; i < 4; ++i)
    bytes[at + 7 - i] = static_cast<char>((len >> (8 * i)) & 0xff);
}

/// A socket connected to 127.0.0.1:port (blocking; reads time out after 100 ms).
inline int raw_connect(std::uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error("socket failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    auto why =
        std::string{"connect to port "} + std::to_string(port) + " failed: " + std::strerror(errno);
    close(fd);
    throw std::runtime_error(why);
  }
  timeval tv{0, 100'000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  return fd;
}

/// Sends all of `bytes` unless the peer closes or stops reading; true when all went out.
inline bool send_all(int fd, const std::string& bytes) {
  std::size_t sent = 0;
  while (sent < bytes.size()) {
    auto n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<std::size_t>(n);
  }
  return true;
}

/// Reads until the peer closes the connection (true) or `limit` passes (false); what was
/// read goes to `out` when given.
inline bool closed_by_peer_within(int fd, std::chrono::milliseconds limit,
                                  std::string* out = nullptr) {
  auto until = std::chrono::steady_clock::now() + limit;
  char buf[65536];
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(std::max<std::int64_t>(left.count(), 0))) > 0) {
      auto n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n == 0) return true;
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return true;
      if (n > 0 && out != nullptr) out->append(buf, static_cast<std::size_t>(n));
    } else if (left.count() <= 0) {
      return false;
    }
  }
}

/// A field of /proc/PID/status, e.g. "VmRSS" (kB) or "Threads".
inline long proc_status(pid_t pid, const std::string& field) {
  std::ifstream in{"/proc/" + std::to_string(pid) + "/status"};
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
  return -1;
}

/// A listening socket on 127.0.0.1 (any port).
inline int raw_listen(std::uint16_t& port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);  // 0: any free port
  int one = 1;
  if (fd >= 0 && port != 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      listen(fd, 16) != 0)
    throw std::runtime_error("cannot listen");
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  port = ntohs(addr.sin_port);
  return fd;
}

/// Forwards one connection to 127.0.0.1:target and records what the client sent.
class recording_relay {
 public:
  explicit recording_relay(std::uint16_t target) {
    listener_ = raw_listen(port_);
    thread_ = std::thread{[this, target] { run(target); }};
  }
  ~recording_relay() {
    stop_ = true;
    thread_.join();
    close(listener_);
  }
  std::uint16_t port() const { return port_; }
  std::string client_bytes() {
    std::lock_guard<std::mutex> guard{mtx_};
    return client_bytes_;
  }

 private:
  void run(std::uint16_t target) {
    pollfd lp{listener_, POLLIN, 0};
    while (!stop_ && poll(&lp, 1, 50) <= 0) {
    }
    if (stop_) return;
    int client = accept(listener_, nullptr, nullptr);
    int node = raw_connect(target);
    char buf[65536];
    while (!stop_) {
      pollfd fds[2] = {{client, POLLIN, 0}, {node, POLLIN, 0}};
      if (poll(fds, 2, 50) <= 0) continue;
      for (int i = 0; i < 2; ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        auto n = ::recv(fds[i].fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n <= 0) {
          if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
          stop_ = true;
          break;
        }
        if (i == 0) {
          std::lock_guard<std::mutex> guard{mtx_};
          client_bytes_.append(buf, static_cast<std::size_t>(n));
        }
        int other = i == 0 ? node : client;
        timeval tv{5, 0};
        setsockopt(other, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        send_all(other, std::string{buf, static_cast<std::size_t>(n)});
      }
    }
    close(client);
    close(node);
  }

  int listener_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mtx_;
  std::string client_bytes_;
};

/// Splits a captured BASP stream into frames (header plus payload).
inline std::vector<std::string> basp_frames(const std::string& bytes) {
  std::vector<std::string> frames;
  std::size_t at = 0;
  while (at + basp::header_size <= bytes.size()) {
    auto len = basp::header_size + payload_len_at(bytes, at);
    if (at + len > bytes.size()) break;
    frames.push_back(bytes.substr(at, len));
    at += len;
  }
  return frames;
}

/// One mutated version of a session: bit flips, rewritten length fields (huge ones too),
/// truncations, duplicated, dropped and swapped messages, inserted noise.
inline std::string mutate(const std::vector<std::string>& session, std::mt19937_64& rng) {
  auto frames = session;
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  int mutations = 1 + static_cast<int>(pick(3));
  bool truncate = false;
  for (int m = 0; m < mutations; ++m) {
    if (frames.empty()) break;
    auto& f = frames[pick(frames.size())];
    switch (pick(7)) {
      case 0:  // bit flips
        for (std::size_t k = 1 + pick(8); k > 0; --k) f[pick(f.size())] ^= char(1 << pick(8));
        break;
      case 1: {  // length field
        static const std::uint32_t lens[] = {
            0u, 1u, 31u, 0x7fffffffu, 0x80000000u, 0xffffffffu, (64u << 20) + 1u};
        auto old = payload_len_at(f, 0);
        std::uint32_t len = pick(3) == 0   ? old + 1 - 2 * static_cast<std::uint32_t>(pick(2))
                            : pick(2) == 0 ? lens[pick(std::size(lens))]
                                           : static_cast<std::uint32_t>(rng());
        set_payload_len_at(f, 0, len);
        break;
      }
      case 2:
        truncate = true;
        break;
      case 3:  // duplicate
        frames.insert(frames.begin() + static_cast<long>(pick(frames.size() + 1)), f);
        break;
      case 4:  // drop
        frames.erase(frames.begin() + static_cast<long>(pick(frames.size())));
        break;
      case 5:  // swap
        std::swap(f, frames[pick(frames.size())]);
        break;
      default: {  // noise
        std::string noise(1 + pick(64), '\0');
        for (auto& ch : noise) ch = static_cast<char>(rng());
        f.insert(pick(f.size() + 1), noise);
        break;
      }
    }
  }
  std::string out;
  for (auto& f : frames) out += f;
  if (truncate && !out.empty()) out.resize(pick(out.size()));
  return out;
}

/// The frames of `captured`, with `sys`'s node id rewritten to another one of the same size
/// wherever it occurs (`fill` makes it): replays must not claim the node id of this process,
/// which connects to the target node afterwards. Throws when the capture has no whole frame.
inline std::vector<std::string> replayable_frames(const std::string& captured,
                                                  caf::actor_system& sys, std::uint8_t fill) {
  auto session = basp_frames(captured);
  auto bytes_of = [&](const caf::node_id& id) {
    std::vector<char> out;
    caf::binary_serializer sink{sys, out};
    if (sink(id)) throw std::runtime_error("serialize node id");
    return std::string{out.begin(), out.end()};
  };
  caf::node_id::default_data::host_id_type host;
  host.fill(fill);
  auto mine = bytes_of(sys.node()), other = bytes_of(caf::make_node_id(700 + fill, host));
  if (mine.size() != other.size()) throw std::runtime_error("node ids of another size");
  for (auto& f : session)
    for (auto at = f.find(mine); at != std::string::npos; at = f.find(mine, at + 1))
      f.replace(at, mine.size(), other);
  return session;
}

}  // namespace wire_attack
