// The ring all-reduce's data plane (ring_plane.hpp): the listener where a replica's left
// neighbour connects, and the connections parked for the next ring.
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include "ring_plane.hpp"
#include "ring_plane_io.hpp"

namespace troupe::detail::ring_plane {

using namespace io;

listener::listener(const std::string& host) {
  auto ai = resolve(host, 0, true);
  int err = 0;
  for (auto* a = ai.head; a != nullptr; a = a->ai_next) {
    fd_guard s{::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)};
    if (s.fd < 0) {
      err = errno;
      continue;
    }
    if (::bind(s.fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(s.fd, SOMAXCONN) != 0) {
      err = errno;
      continue;
    }
    sockaddr_storage got{};
    socklen_t len = sizeof got;
    if (::getsockname(s.fd, reinterpret_cast<sockaddr*>(&got), &len) != 0) {
      err = errno;
      continue;
    }
    port_ = ntohs(got.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&got)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&got)->sin_port);
    fd_ = std::exchange(s.fd, -1);
    return;
  }
  throw std::runtime_error("cannot listen on " + host + " for ring data: " + errno_text(err));
}

listener::~listener() {
  for (auto& p : parked_) ::close(p.fd);
  if (fd_ >= 0) ::close(fd_);
}

void listener::park(int fd, const hello& h, std::uint64_t id, std::uint64_t current) {
  std::lock_guard<std::mutex> guard{mtx_};
  if (id <= current || id - current > (std::uint64_t{1} << 20)) {
    ::close(fd);
    return;
  }
  if (parked_.size() >= 4) {
    auto farthest = std::max_element(parked_.begin(), parked_.end(),
                                     [](const parked& a, const parked& b) { return a.id < b.id; });
    if (farthest->id <= id) {
      ::close(fd);
      return;
    }
    ::close(farthest->fd);
    parked_.erase(farthest);
  }
  parked_.push_back(parked{fd, h, id});
}

int listener::take_parked(const hello& h, std::uint64_t id) {
  std::lock_guard<std::mutex> guard{mtx_};
  int found = -1;
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (found < 0 && it->h == h) {
      found = it->fd;
    } else if (it->id > id) {
      ++it;
      continue;
    } else {
      ::close(it->fd);
    }
    it = parked_.erase(it);
  }
  return found;
}

}  // namespace troupe::detail::ring_plane
