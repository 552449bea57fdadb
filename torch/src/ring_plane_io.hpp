// The ring all-reduce's data plane (ring_plane.hpp), its sockets' small parts: shared by the
// listener (ring_plane_listener.cpp) and a ring's run (ring_plane.cpp).
#pragma once

#include <netdb.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace troupe::detail::ring_plane::io {

inline constexpr char magic[8] = {'t', 'r', 'o', 'u', 'p', 'e', 'R', '1'};
inline constexpr std::size_t hello_size = 8 + 16 + 8;  ///< magic, key, ring id

using clock = std::chrono::steady_clock;

inline std::string errno_text(int e) {
  return std::strerror(e);
}

/// A file descriptor closed on destruction.
struct fd_guard {
  int fd = -1;
  fd_guard() = default;
  explicit fd_guard(int f) : fd(f) {}
  fd_guard(fd_guard&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
  fd_guard& operator=(fd_guard&& o) noexcept {
    if (this != &o) {
      reset();
      fd = std::exchange(o.fd, -1);
    }
    return *this;
  }
  fd_guard(const fd_guard&) = delete;
  fd_guard& operator=(const fd_guard&) = delete;
  ~fd_guard() { reset(); }
  void reset() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

struct addrinfo_list {
  addrinfo* head = nullptr;
  ~addrinfo_list() {
    if (head) freeaddrinfo(head);
  }
};

inline addrinfo_list resolve(const std::string& host, std::uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo_list out;
  auto h = host;
  if (h.size() > 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  int rc =
      getaddrinfo(h.empty() ? nullptr : h.c_str(), std::to_string(port).c_str(), &hints, &out.head);
  if (rc != 0 || out.head == nullptr)
    throw std::runtime_error("cannot resolve " + host + ": " + gai_strerror(rc));
  return out;
}

inline void write_u64(unsigned char* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

inline std::uint64_t read_u64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace troupe::detail::ring_plane::io
