// The ring all-reduce's data plane (ring_plane.hpp): the listener and a ring's run (its thread);
// keys, the chunks' slicing and the tests' switches are in ring_plane_keys.cpp.
#include "ring_plane.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace troupe::detail::ring_plane {
namespace {

constexpr char magic[8] = {'t', 'r', 'o', 'u', 'p', 'e', 'R', '1'};
constexpr std::size_t hello_size = 8 + 16 + 8;  ///< magic, key, ring id

using clock = std::chrono::steady_clock;

std::string errno_text(int e) {
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

addrinfo_list resolve(const std::string& host, std::uint16_t port, bool passive) {
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

void write_u64(unsigned char* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

std::uint64_t read_u64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

void run::add_into(unsigned char* dst, const unsigned char* src, std::size_t bytes) const {
  // A plain loop for the usual dtypes (vectorized by the compiler): LibTorch's add_ would start
  // an OpenMP team for this thread, a new one for every ring's thread.
  auto sum = [&](auto* d, const auto* s, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) d[i] += s[i];
  };
  switch (s_.buf.scalar_type()) {
    case at::kFloat:
      return sum(reinterpret_cast<float*>(dst), reinterpret_cast<const float*>(src),
                 bytes / sizeof(float));
    case at::kDouble:
      return sum(reinterpret_cast<double*>(dst), reinterpret_cast<const double*>(src),
                 bytes / sizeof(double));
    default: {
      auto count =
          static_cast<std::int64_t>(bytes) / static_cast<std::int64_t>(s_.buf.element_size());
      at::from_blob(dst, {count}, s_.buf.options())
          .add_(at::from_blob(const_cast<unsigned char*>(src), {count}, s_.buf.options()));
    }
  }
}

// -- listener -----------------------------------------------------------------------------------

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

// -- run ----------------------------------------------------------------------------------------

run::run(listener& l, spec s, std::function<void(bool, const std::string&)> done)
    : l_(l), s_(std::move(s)), done_(std::move(done)) {
  if (s_.n < 2 || s_.pos >= s_.n || s_.pieces == 0) throw std::invalid_argument("a malformed ring");
  if (!s_.buf.defined() || !s_.buf.is_cpu() || !s_.buf.is_contiguous())
    throw std::invalid_argument("ring data must be a contiguous CPU tensor");
  wake_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_ < 0) throw std::runtime_error("eventfd: " + errno_text(errno));
  try {
    thread_ = std::thread([this] { body(); });
  } catch (...) {
    ::close(wake_);
    throw;
  }
}

run::~run() {
  cancelled_.store(true);
  std::uint64_t one = 1;
  [[maybe_unused]] auto w = ::write(wake_, &one, sizeof one);
  if (thread_.joinable()) thread_.join();
  ::close(wake_);
}

void run::body() {
  std::string what;
  bool ok = false;
  try {
    loop();
    ok = true;
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "unknown error";
  }
  if (!cancelled_.load()) done_(ok, what);
}

void run::loop() {
  const auto n = s_.n, pos = s_.pos, pieces = s_.pieces;
  const auto numel = s_.buf.numel();
  const auto esize = static_cast<std::int64_t>(s_.buf.element_size());
  auto* base = static_cast<unsigned char*>(s_.buf.data_ptr());
  const std::size_t messages = std::size_t{2} * (n - 1) * pieces;  // each way, hop-major

  // Which chunk a hop carries, added in or copied (ring_schedule.hpp).
  const schedule plan{n, pos};
  auto bytes_of = [&](std::uint32_t piece, std::uint32_t k) {
    auto [b, e] = chunk_range(numel, pieces, n, piece, k);
    return std::pair<unsigned char*, std::size_t>{base + b * esize,
                                                  static_cast<std::size_t>((e - b) * esize)};
  };
  std::size_t largest = 0;
  for (std::uint32_t p = 0; p < pieces; ++p)
    for (std::uint32_t k = 0; k < n; ++k) largest = std::max(largest, bytes_of(p, k).second);
  auto* scratch = l_.scratch(largest);

  if (int delay = test_delay_ms.load(); delay > 0) {
    pollfd w{wake_, POLLIN, 0};
    ::poll(&w, 1, delay);
    if (cancelled_.load()) return;
  }

  // The connection to the right neighbour: non-blocking connect to each of the host's addresses
  // in turn (a name such as "localhost" may resolve to ::1 and 127.0.0.1), then the hello.
  fd_guard out;
  auto addresses = resolve(s_.right_host, s_.right_port, false);
  const addrinfo* next_address = addresses.head;
  int connect_err = ECONNREFUSED;
  auto connect_next = [&] {  // starts connecting to the next address; throws when none is left
    out.reset();
    for (; next_address != nullptr && out.fd < 0; next_address = next_address->ai_next) {
      auto* a = next_address;
      fd_guard s{::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)};
      if (s.fd < 0) {
        connect_err = errno;
        continue;
      }
      if (::connect(s.fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
        connect_err = errno;
        continue;
      }
      out = std::move(s);
    }
    if (out.fd < 0)
      throw std::runtime_error("cannot connect to the next replica's data port " + s_.right_host +
                               ":" + std::to_string(s_.right_port) + ": " +
                               errno_text(connect_err));
    int one = 1;
    ::setsockopt(out.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  };
  connect_next();
  bool connecting = true;
  listener::hello hello{};
  std::memcpy(hello.data(), magic, 8);
  std::memcpy(hello.data() + 8, s_.secret.data(), 16);
  write_u64(hello.data() + 24, s_.id);
  std::size_t hello_sent = 0;

  // Connections accepted, waiting for their hello; the left neighbour's once it checked out.
  struct pending {
    fd_guard fd;
    unsigned char got[hello_size];
    std::size_t n = 0;
    clock::time_point deadline;
  };
  std::vector<pending> waiting;
  fd_guard in{l_.take_parked(hello, s_.id)};  // it came while the last ring still ran here
  const auto connect_until = clock::now() + s_.connect_deadline;

  std::size_t sent = 0, send_off = 0;  // messages sent, bytes of the next one
  std::size_t recvd = 0, recv_off = 0;
  auto stall_until = clock::now() + s_.stall;
  auto hop_of = [&](std::size_t m) { return static_cast<std::uint32_t>(m / pieces); };
  auto piece_of = [&](std::size_t m) { return static_cast<std::uint32_t>(m % pieces); };
  // Message m may go once what it passes on has arrived (and been added in).
  auto sendable = [&] { return sent < messages && (sent < pieces || recvd > sent - pieces); };

  std::vector<pollfd> fds;
  while (sent < messages || recvd < messages) {
    fds.clear();
    fds.push_back({wake_, POLLIN, 0});
    short out_events = 0;
    if (connecting || hello_sent < hello_size || sendable()) out_events = POLLOUT;
    // A connection with nothing left to do is left out (its hang-up would wake every poll).
    fds.push_back({sent < messages || hello_sent < hello_size ? out.fd : -1, out_events, 0});
    fds.push_back({recvd < messages ? in.fd : -1, POLLIN, 0});
    fds.push_back({l_.fd(), POLLIN, 0});
    for (auto& p : waiting) fds.push_back({p.fd.fd, POLLIN, 0});
    auto now = clock::now();
    auto until = stall_until;
    if (connecting || in.fd < 0) until = std::min(until, connect_until);
    for (auto& p : waiting) until = std::min(until, p.deadline);
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count() + 1;
    int rc = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(0, ms)));
    if (rc < 0 && errno != EINTR) throw std::runtime_error("poll: " + errno_text(errno));
    if (cancelled_.load()) return;
    now = clock::now();
    bool moved = false;

    // New connections and their hellos, for as long as the ring lasts: the left neighbour's is
    // taken, one for a later ring (the neighbour already on it) is parked for that ring's run,
    // the others are closed at once (a flood can then fill the backlog only between rings). A
    // hello is read as soon as its connection is accepted, and more than max_pending silent
    // ones evict the oldest, never a connection whose hello has arrived.
    {
      auto read_hello = [&](pending& p) {  // true: p is the neighbour; p.fd reset: drop it
        auto r = ::recv(p.fd.fd, p.got + p.n, hello_size - p.n, 0);
        if (r > 0) p.n += static_cast<std::size_t>(r);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) p.fd.reset();
        if (p.fd.fd < 0 || p.n < hello_size) return false;
        listener::hello h;
        std::memcpy(h.data(), p.got, hello_size);
        if (h == hello && in.fd < 0) return true;
        if (std::memcmp(p.got, magic, 8) == 0)  // kept only when it names a ring just ahead
          l_.park(std::exchange(p.fd.fd, -1), h, read_u64(p.got + 24), s_.id);
        p.fd.reset();  // a ring given up on, or a stranger
        return false;
      };
      auto take = [&](pending& p) {
        in = std::move(p.fd);
        moved = true;
      };
      for (auto it = waiting.begin(); it != waiting.end();) {
        if (now < it->deadline && read_hello(*it)) take(*it);
        it = it->fd.fd < 0 || now >= it->deadline ? waiting.erase(it) : it + 1;
      }
      for (;;) {
        int c = ::accept4(l_.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0) break;
        pending p{fd_guard{c}, {}, 0, now + s_.hello_deadline};
        if (read_hello(p)) {
          take(p);
          continue;
        }
        if (p.fd.fd < 0) continue;
        if (waiting.size() >= s_.max_pending) waiting.erase(waiting.begin());  // the oldest
        waiting.push_back(std::move(p));
      }
    }

    // To the right: finish connecting, the hello, then every message whose turn it is.
    if (fds[1].revents & (POLLOUT | POLLERR | POLLHUP)) {
      if (connecting) {
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(out.fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err != 0) {
          connect_err = err;
          connect_next();  // the host's next address, or the error
          continue;
        }
        connecting = false;
      }
      if ((fds[1].revents & (POLLERR | POLLHUP)) && sent < messages)
        throw std::runtime_error("the next replica's connection failed");
      while (hello_sent < hello_size) {
        auto w = ::send(out.fd, hello.data() + hello_sent, hello_size - hello_sent, MSG_NOSIGNAL);
        if (w <= 0) break;
        hello_sent += static_cast<std::size_t>(w);
        moved = true;
      }
      while (hello_sent == hello_size && sendable()) {
        auto [p, len] = bytes_of(piece_of(sent), plan.sent(hop_of(sent)));
        if (len > send_off) {
          auto w = ::send(out.fd, p + send_off, len - send_off, MSG_NOSIGNAL);
          if (w < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            throw std::runtime_error("the next replica's connection failed: " + errno_text(errno));
          }
          send_off += static_cast<std::size_t>(w);
          moved = true;
        }
        if (send_off == len) {
          ++sent;
          send_off = 0;
        }
      }
    }

    // From the left: into the chunk itself (all-gather) or the scratch buffer, then added in.
    if (in.fd >= 0 && (fds[2].revents & (POLLIN | POLLERR | POLLHUP))) {
      while (recvd < messages) {
        auto h = hop_of(recvd);
        auto [p, len] = bytes_of(piece_of(recvd), plan.received(h));
        auto* into = plan.adds(h) ? scratch : p;
        if (len > recv_off) {
          auto r = ::recv(in.fd, into + recv_off, len - recv_off, 0);
          if (r == 0) throw std::runtime_error("the previous replica closed its connection");
          if (r < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            throw std::runtime_error("the previous replica's connection failed: " +
                                     errno_text(errno));
          }
          recv_off += static_cast<std::size_t>(r);
          moved = true;
        }
        if (recv_off < len) continue;
        if (plan.adds(h) && len > 0) add_into(p, scratch, len);
        ++recvd;
        recv_off = 0;
      }
    }
    if (moved) stall_until = now + s_.stall;
    if (now >= connect_until && (connecting || in.fd < 0))
      throw std::runtime_error((connecting ? "could not connect to the next replica's data port " +
                                                 s_.right_host + ":" + std::to_string(s_.right_port)
                                           : std::string{"the previous replica did not connect"}) +
                               " within " + std::to_string(s_.connect_deadline.count()) + " ms");
    if (now >= stall_until)
      throw std::runtime_error("no ring data moved for " + std::to_string(s_.stall.count()) +
                               " ms");
  }
}

}  // namespace troupe::detail::ring_plane
