// The ring all-reduce's data plane (ring_plane.hpp): a ring's run on its thread. Its loop
// polls three parts: connecting to the right neighbour (right_link), accepting the left one
// among whoever connects (left_accept), and transferring the schedule's chunks
// (ring_schedule.hpp) both ways (transfer). The listener: ring_plane_listener.cpp; keys and the
// tests' switches: ring_plane_keys.cpp.
#include "ring_plane.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "ring_plane_io.hpp"

namespace troupe::detail::ring_plane {

using namespace io;

namespace {

/// The connection to the right neighbour: a non-blocking connect to each of its host's
/// addresses in turn (a name such as "localhost" may resolve to ::1 and 127.0.0.1), then the
/// hello.
class right_link {
 public:
  right_link(const spec& s, const listener::hello& hello)
      : s_(s), hello_(hello), addresses_(resolve(s.right_host, s.right_port, false)) {
    next_ = addresses_.head;
    connect_next();
  }
  [[nodiscard]] int fd() const { return out_.fd; }
  [[nodiscard]] bool connecting() const { return connecting_; }
  [[nodiscard]] bool hello_sent() const { return sent_ == hello_size; }
  /// Whether the next poll waits for it to be writable (connecting, the hello, or `data`).
  [[nodiscard]] bool wants_out(bool data) const { return connecting_ || !hello_sent() || data; }

  /// After a poll that saw `revents`: finishes connecting (or tries the next address), then
  /// sends the hello. False: connecting goes on (poll again). Throws when it failed.
  bool ready(short revents, bool more_to_send, bool& moved) {
    if (connecting_) {
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(out_.fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        err_ = err;
        connect_next();  // the host's next address, or the error
        return false;
      }
      connecting_ = false;
    }
    if ((revents & (POLLERR | POLLHUP)) && more_to_send)
      throw std::runtime_error("the next replica's connection failed");
    while (sent_ < hello_size) {
      auto w = ::send(out_.fd, hello_.data() + sent_, hello_size - sent_, MSG_NOSIGNAL);
      if (w <= 0) break;
      sent_ += static_cast<std::size_t>(w);
      moved = true;
    }
    return true;
  }

 private:
  /// Starts connecting to the next address; throws when none is left.
  void connect_next() {
    out_.reset();
    for (; next_ != nullptr && out_.fd < 0; next_ = next_->ai_next) {
      auto* a = next_;
      fd_guard s{::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)};
      if (s.fd < 0) {
        err_ = errno;
        continue;
      }
      if (::connect(s.fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
        err_ = errno;
        continue;
      }
      out_ = std::move(s);
    }
    if (out_.fd < 0)
      throw std::runtime_error("cannot connect to the next replica's data port " + s_.right_host +
                               ":" + std::to_string(s_.right_port) + ": " + errno_text(err_));
    int one = 1;
    ::setsockopt(out_.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    connecting_ = true;
  }

  const spec& s_;
  const listener::hello& hello_;
  addrinfo_list addresses_;
  const addrinfo* next_ = nullptr;
  int err_ = ECONNREFUSED;
  fd_guard out_;
  bool connecting_ = true;
  std::size_t sent_ = 0;  ///< bytes of the hello
};

/// The connections the listener accepts while the ring lasts, each until its hello arrived:
/// the left neighbour's is taken, one for a later ring (the neighbour already on it) is parked
/// for that ring's run, the others are closed at once (a flood can then fill the backlog only
/// between rings). A hello is read as soon as its connection is accepted, and more than
/// max_pending silent ones evict the oldest, never a connection whose hello has arrived.
class left_accept {
 public:
  /// The left neighbour's connection may have come while the last ring still ran here.
  left_accept(listener& l, const spec& s, const listener::hello& hello)
      : l_(l), s_(s), hello_(hello), in_(l.take_parked(hello, s.id)) {}
  [[nodiscard]] int fd() const { return in_.fd; }
  /// The listener's and the waiting connections' fds.
  void add_fds(std::vector<pollfd>& fds) const {
    fds.push_back({l_.fd(), POLLIN, 0});
    for (auto& p : waiting_) fds.push_back({p.fd.fd, POLLIN, 0});
  }
  [[nodiscard]] clock::time_point until(clock::time_point t) const {
    for (auto& p : waiting_) t = std::min(t, p.deadline);
    return t;
  }
  /// Reads the hellos that came and accepts new connections.
  void poll(clock::time_point now, bool& moved) {
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (now < it->deadline && read_hello(*it)) take(*it, moved);
      it = it->fd.fd < 0 || now >= it->deadline ? waiting_.erase(it) : it + 1;
    }
    for (;;) {
      int c = ::accept4(l_.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (c < 0) break;
      pending p{fd_guard{c}, {}, 0, now + s_.hello_deadline};
      if (read_hello(p)) {
        take(p, moved);
        continue;
      }
      if (p.fd.fd < 0) continue;
      if (waiting_.size() >= s_.max_pending) waiting_.erase(waiting_.begin());  // the oldest
      waiting_.push_back(std::move(p));
    }
  }

 private:
  struct pending {
    fd_guard fd;
    unsigned char got[hello_size];
    std::size_t n = 0;
    clock::time_point deadline;
  };
  /// True: p is the neighbour; p.fd reset: drop it.
  bool read_hello(pending& p) {
    auto r = ::recv(p.fd.fd, p.got + p.n, hello_size - p.n, 0);
    if (r > 0) p.n += static_cast<std::size_t>(r);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) p.fd.reset();
    if (p.fd.fd < 0 || p.n < hello_size) return false;
    listener::hello h;
    std::memcpy(h.data(), p.got, hello_size);
    if (h == hello_ && in_.fd < 0) return true;
    if (std::memcmp(p.got, magic, 8) == 0)  // kept only when it names a ring just ahead
      l_.park(std::exchange(p.fd.fd, -1), h, read_u64(p.got + 24), s_.id);
    p.fd.reset();  // a ring given up on, or a stranger
    return false;
  }
  void take(pending& p, bool& moved) {
    in_ = std::move(p.fd);
    moved = true;
  }

  listener& l_;
  const spec& s_;
  const listener::hello& hello_;
  fd_guard in_;
  std::vector<pending> waiting_;
};

/// dst += src, `bytes` of them, of the dtype of `like`. A plain loop for the usual dtypes
/// (vectorized by the compiler): LibTorch's add_ would start an OpenMP team for this thread, a
/// new one for every ring's thread.
void add_into(const at::Tensor& like, unsigned char* dst, const unsigned char* src,
              std::size_t bytes) {
  auto sum = [&](auto* d, const auto* s, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) d[i] += s[i];
  };
  switch (like.scalar_type()) {
    case at::kFloat:
      return sum(reinterpret_cast<float*>(dst), reinterpret_cast<const float*>(src),
                 bytes / sizeof(float));
    case at::kDouble:
      return sum(reinterpret_cast<double*>(dst), reinterpret_cast<const double*>(src),
                 bytes / sizeof(double));
    default: {
      auto count =
          static_cast<std::int64_t>(bytes) / static_cast<std::int64_t>(like.element_size());
      at::from_blob(dst, {count}, like.options())
          .add_(at::from_blob(const_cast<unsigned char*>(src), {count}, like.options()));
    }
  }
}

/// The schedule's chunks both ways (hop-major, `pieces` messages a hop): to the right each
/// message once what it passes on has arrived (and been added in); from the left into the
/// chunk itself (all-gather) or the scratch buffer, then added in.
class transfer {
 public:
  explicit transfer(const spec& s)
      : s_(s),
        plan_{s.n, s.pos},
        messages_(std::size_t{2} * (s.n - 1) * s.pieces),
        numel_(s.buf.numel()),
        esize_(static_cast<std::int64_t>(s.buf.element_size())),
        base_(static_cast<unsigned char*>(s.buf.data_ptr())) {}
  /// The largest chunk: what the scratch buffer must hold.
  [[nodiscard]] std::size_t largest() const {
    std::size_t most = 0;
    for (std::uint32_t p = 0; p < s_.pieces; ++p)
      for (std::uint32_t k = 0; k < s_.n; ++k) most = std::max(most, bytes_of(p, k).second);
    return most;
  }
  void use_scratch(unsigned char* scratch) { scratch_ = scratch; }
  [[nodiscard]] bool sending() const { return sent_ < messages_; }
  [[nodiscard]] bool receiving() const { return recvd_ < messages_; }
  [[nodiscard]] bool sendable() const {
    return sent_ < messages_ && (sent_ < s_.pieces || recvd_ > sent_ - s_.pieces);
  }

  /// Sends what may go on `fd` until it would block.
  void send(int fd, bool& moved) {
    while (sendable()) {
      auto [p, len] = bytes_of(piece_of(sent_), plan_.sent(hop_of(sent_)));
      if (len > send_off_) {
        auto w = ::send(fd, p + send_off_, len - send_off_, MSG_NOSIGNAL);
        if (w < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
          throw std::runtime_error("the next replica's connection failed: " + errno_text(errno));
        }
        send_off_ += static_cast<std::size_t>(w);
        moved = true;
      }
      if (send_off_ == len) {
        ++sent_;
        send_off_ = 0;
      }
    }
  }

  /// Receives from `fd` until it would block.
  void receive(int fd, bool& moved) {
    while (recvd_ < messages_) {
      auto h = hop_of(recvd_);
      auto [p, len] = bytes_of(piece_of(recvd_), plan_.received(h));
      auto* into = plan_.adds(h) ? scratch_ : p;
      if (len > recv_off_) {
        auto r = ::recv(fd, into + recv_off_, len - recv_off_, 0);
        if (r == 0) throw std::runtime_error("the previous replica closed its connection");
        if (r < 0) {
          if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
          throw std::runtime_error("the previous replica's connection failed: " +
                                   errno_text(errno));
        }
        recv_off_ += static_cast<std::size_t>(r);
        moved = true;
      }
      if (recv_off_ < len) continue;
      if (plan_.adds(h) && len > 0) add_into(s_.buf, p, scratch_, len);
      ++recvd_;
      recv_off_ = 0;
    }
  }

 private:
  [[nodiscard]] std::pair<unsigned char*, std::size_t> bytes_of(std::uint32_t piece,
                                                                std::uint32_t k) const {
    auto [b, e] = chunk_range(numel_, s_.pieces, s_.n, piece, k);
    return {base_ + b * esize_, static_cast<std::size_t>((e - b) * esize_)};
  }
  [[nodiscard]] std::uint32_t hop_of(std::size_t m) const {
    return static_cast<std::uint32_t>(m / s_.pieces);
  }
  [[nodiscard]] std::uint32_t piece_of(std::size_t m) const {
    return static_cast<std::uint32_t>(m % s_.pieces);
  }

  const spec& s_;
  const schedule plan_;  // which chunk a hop carries, added in or copied
  const std::size_t messages_;
  const std::int64_t numel_, esize_;
  unsigned char* base_;
  unsigned char* scratch_ = nullptr;
  std::size_t sent_ = 0, send_off_ = 0;  // messages sent, bytes of the next one
  std::size_t recvd_ = 0, recv_off_ = 0;
};

}  // namespace

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
  transfer data{s_};
  data.use_scratch(l_.scratch(data.largest()));

  if (int delay = test_delay_ms.load(); delay > 0) {
    pollfd w{wake_, POLLIN, 0};
    ::poll(&w, 1, delay);
    if (cancelled_.load()) return;
  }

  listener::hello hello{};
  std::memcpy(hello.data(), magic, 8);
  std::memcpy(hello.data() + 8, s_.secret.data(), 16);
  write_u64(hello.data() + 24, s_.id);
  right_link out{s_, hello};
  left_accept in{l_, s_, hello};
  const auto connect_until = clock::now() + s_.connect_deadline;
  auto stall_until = clock::now() + s_.stall;

  std::vector<pollfd> fds;
  while (data.sending() || data.receiving()) {
    fds.clear();
    fds.push_back({wake_, POLLIN, 0});
    // A connection with nothing left to do is left out (its hang-up would wake every poll).
    fds.push_back({data.sending() || !out.hello_sent() ? out.fd() : -1,
                   static_cast<short>(out.wants_out(data.sendable()) ? POLLOUT : 0), 0});
    fds.push_back({data.receiving() ? in.fd() : -1, POLLIN, 0});
    in.add_fds(fds);
    auto now = clock::now();
    auto until = in.until(stall_until);
    if (out.connecting() || in.fd() < 0) until = std::min(until, connect_until);
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count() + 1;
    int rc = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(0, ms)));
    if (rc < 0 && errno != EINTR) throw std::runtime_error("poll: " + errno_text(errno));
    if (cancelled_.load()) return;
    now = clock::now();
    bool moved = false;
    in.poll(now, moved);
    // To the right once connected and the hello is out; from the left once accepted.
    if ((fds[1].revents & (POLLOUT | POLLERR | POLLHUP)) &&
        out.ready(fds[1].revents, data.sending(), moved) && out.hello_sent())
      data.send(out.fd(), moved);
    if (in.fd() >= 0 && (fds[2].revents & (POLLIN | POLLERR | POLLHUP)))
      data.receive(in.fd(), moved);
    if (moved) stall_until = now + s_.stall;
    if (now >= connect_until && (out.connecting() || in.fd() < 0))
      throw std::runtime_error((out.connecting()
                                    ? "could not connect to the next replica's data port " +
                                          s_.right_host + ":" + std::to_string(s_.right_port)
                                    : std::string{"the previous replica did not connect"}) +
                               " within " + std::to_string(s_.connect_deadline.count()) + " ms");
    if (now >= stall_until)
      throw std::runtime_error("no ring data moved for " + std::to_string(s_.stall.count()) +
                               " ms");
  }
}

}  // namespace troupe::detail::ring_plane
