// The ring's data plane (torch/src/ring_plane.hpp) attacked directly: strangers knocking on a
// replica's data port during a ring, neighbours that close or go silent mid-ring, a neighbour
// that never comes, one that cannot be reached, and a ring cancelled while it waits.
#include "ring_plane.hpp"

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "test_util.hpp"

namespace {

namespace rp = troupe::detail::ring_plane;
using namespace std::chrono_literals;

/// A blocking TCP client connected to 127.0.0.1:port.
int dial(std::uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
    throw std::runtime_error("dial failed");
  return fd;
}

void send_all(int fd, const void* p, std::size_t n) {
  auto* c = static_cast<const char*>(p);
  while (n > 0) {
    auto w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w <= 0) return;
    c += w;
    n -= static_cast<std::size_t>(w);
  }
}

/// The 32 bytes a ring member sends first.
std::string hello(const rp::key& k, std::uint64_t id) {
  std::string h = "troupeR1";
  h.append(reinterpret_cast<const char*>(k.data()), k.size());
  for (int i = 0; i < 8; ++i) h += static_cast<char>(id >> (8 * i));
  return h;
}

struct outcome {
  std::promise<std::pair<bool, std::string>> p;
  std::future<std::pair<bool, std::string>> f = p.get_future();
  std::function<void(bool, const std::string&)> callback() {
    return [this](bool ok, const std::string& what) { p.set_value({ok, what}); };
  }
};

rp::spec spec_for(std::uint64_t id, const rp::key& k, std::uint32_t pos, std::uint32_t n,
                  std::uint16_t right_port, at::Tensor buf) {
  rp::spec s;
  s.id = id;
  s.secret = k;
  s.pos = pos;
  s.n = n;
  s.pieces = 4;
  s.right_host = "127.0.0.1";
  s.right_port = right_port;
  s.buf = std::move(buf);
  return s;
}

TEST(RingPlane, ThreeReplicasSumExactlyWhileStrangersKnockOnTheirPorts) {
  test_util::watchdog dog{std::chrono::seconds{60}, "a ring among strangers"};
  constexpr std::uint32_t n = 3;
  const std::int64_t numel = (std::int64_t{1} << 20) + 7;  // 4 MiB of float, uneven chunks
  std::vector<std::unique_ptr<rp::listener>> ports;
  std::vector<at::Tensor> bufs;
  auto expected = at::zeros({numel});
  for (std::uint32_t i = 0; i < n; ++i) {
    ports.push_back(std::make_unique<rp::listener>("127.0.0.1"));
    // Small integers: every order of summation gives the same bits.
    auto b = at::remainder(at::arange(numel, at::kFloat) * (i + 1), 251.0);
    expected.add_(b);
    bufs.push_back(b);
  }
  auto k = rp::random_key();
  const std::uint64_t id = 42;
  // Before the ring: 30 silent connections (more than max_pending) on member 0, a stranger's
  // 32 bytes on member 1, the right magic with a wrong key on member 2, the right key with
  // another ring's id on member 0, and half a hello on member 1.
  std::vector<int> strangers;
  for (int i = 0; i < 30; ++i) strangers.push_back(dial(ports[0]->port()));
  auto knock = [&](std::size_t member, const std::string& bytes) {
    strangers.push_back(dial(ports[member]->port()));
    send_all(strangers.back(), bytes.data(), bytes.size());
  };
  knock(1, std::string(32, 'x'));
  auto wrong = k;
  wrong[3] ^= 1;
  knock(2, hello(wrong, id));
  knock(0, hello(k, id - 1));
  knock(1, hello(k, id).substr(0, 20));
  std::vector<outcome> results(n);
  std::vector<std::unique_ptr<rp::run>> runs;
  for (std::uint32_t i = 0; i < n; ++i)
    runs.push_back(std::make_unique<rp::run>(
        *ports[i], spec_for(id, k, i, n, ports[(i + 1) % n]->port(), bufs[i]),
        results[i].callback()));
  for (std::uint32_t i = 0; i < n; ++i) {
    auto [ok, what] = results[i].f.get();
    EXPECT_TRUE(ok) << i << ": " << what;
  }
  runs.clear();
  for (std::uint32_t i = 0; i < n; ++i) EXPECT_TRUE(at::equal(bufs[i], expected)) << i;
  for (int fd : strangers) ::close(fd);
}

TEST(RingPlane, AConnectionForTheNextRingThatArrivesDuringThisOneIsKeptForIt) {
  // The left neighbour may be on ring 11 while this replica still runs ring 10 (it got no shard
  // in a recomputation, say): ring 10's run must keep that connection for ring 11's run.
  test_util::watchdog dog{std::chrono::seconds{60}, "a connection for the next ring"};
  rp::listener a{"127.0.0.1"}, b{"127.0.0.1"};
  auto k10 = rp::random_key(), k11 = rp::random_key();
  int early = dial(a.port());
  auto h11 = hello(k11, 11);
  send_all(early, h11.data(), h11.size());
  // Strangers behind it, with the magic and later ring ids (huge, or a little later): their keys
  // cannot be checked before their ring, but they must not push ring 11's connection out.
  std::vector<int> strangers;
  for (std::uint64_t id : {~std::uint64_t{0}, ~std::uint64_t{0} - 1, std::uint64_t{12},
                           std::uint64_t{13}, std::uint64_t{14}, std::uint64_t{1} << 40}) {
    strangers.push_back(dial(a.port()));
    auto h = hello(rp::random_key(), id);
    send_all(strangers.back(), h.data(), h.size());
  }
  auto xa = at::ones({1 << 18}), xb = at::full({1 << 18}, 2.0f);
  outcome ra, rb;
  {
    rp::run run_a{a, spec_for(10, k10, 0, 2, b.port(), xa), ra.callback()};
    rp::run run_b{b, spec_for(10, k10, 1, 2, a.port(), xb), rb.callback()};
    EXPECT_TRUE(ra.f.get().first);
    EXPECT_TRUE(rb.f.get().first);
  }
  EXPECT_TRUE(at::equal(xa, at::full({1 << 18}, 3.0f)));
  rp::listener::hello want;
  std::memcpy(want.data(), h11.data(), want.size());
  int kept = a.take_parked(want, 11);
  ASSERT_GE(kept, 0) << "ring 10's run closed ring 11's connection";
  send_all(early, "ping", 4);
  char got[4] = {};
  EXPECT_EQ(::recv(kept, got, 4, MSG_WAITALL), 4);
  EXPECT_EQ(std::string(got, 4), "ping");
  ::close(kept);
  ::close(early);
  for (int fd : strangers) ::close(fd);
}

/// A ring of two in which the test plays the other member with raw sockets: `left` connects
/// to the run's port, `right` is where the run connects.
struct lone_ring {
  rp::listener port{"127.0.0.1"};
  rp::listener right{"127.0.0.1"};  // accepted by hand below
  rp::key k = rp::random_key();
  outcome result;
  std::unique_ptr<rp::run> run;
  /// `connect`: the deadline for the neighbours' connections (by default the stall limit's).
  explicit lone_ring(std::chrono::milliseconds stall = std::chrono::milliseconds{60000},
                     std::optional<std::chrono::milliseconds> connect = std::nullopt) {
    auto s = spec_for(7, k, 0, 2, right.port(), at::ones({1 << 20}));
    s.stall = stall;
    s.connect_deadline = connect ? *connect : std::min(stall, s.connect_deadline);
    run = std::make_unique<rp::run>(port, std::move(s), result.callback());
  }
  /// Connects as the left neighbour and sends the hello.
  int connect_as_left() {
    int fd = dial(port.port());
    auto h = hello(k, 7);
    send_all(fd, h.data(), h.size());
    return fd;
  }
  /// The run's connection to its right neighbour (blocking accept).
  int accept_right() {
    pollfd p{right.fd(), POLLIN, 0};
    ::poll(&p, 1, -1);
    return ::accept(right.fd(), nullptr, nullptr);
  }
};

TEST(RingPlane, ANeighbourThatClosesMidRingFailsTheRingInsteadOfHangingIt) {
  test_util::watchdog dog{std::chrono::seconds{60}, "a neighbour closing mid-ring"};
  lone_ring r;
  int right = r.accept_right();  // kept open and unread: the run's sends block on it
  int left = r.connect_as_left();
  std::string part(1000, '\0');
  send_all(left, part.data(), part.size());  // a quarter of a float's worth of its first message
  ::close(left);
  auto [ok, what] = r.result.f.get();
  EXPECT_FALSE(ok);
  EXPECT_NE(what.find("closed its connection"), std::string::npos) << what;
  ::close(right);
}

TEST(RingPlane, ANeighbourThatResetsTheConnectionItIsSentToFailsTheRing) {
  test_util::watchdog dog{std::chrono::seconds{60}, "a right neighbour resetting"};
  lone_ring r;
  int right = r.accept_right();
  int left = r.connect_as_left();  // says hello, then silence: only the right side can fail
  char buf[64];
  (void)::recv(right, buf, sizeof buf, 0);  // part of what was sent: closing now resets
  ::close(right);
  auto [ok, what] = r.result.f.get();
  EXPECT_FALSE(ok);
  EXPECT_NE(what.find("next replica's connection failed"), std::string::npos) << what;
  ::close(left);
}

TEST(RingPlane, ASilentOrAbsentNeighbourEndsTheRingAtItsStallLimit) {
  test_util::watchdog dog{std::chrono::seconds{60}, "a silent neighbour"};
  {
    // Connections may take a loaded machine longer than the stall limit: 10 s for them.
    lone_ring r{std::chrono::milliseconds{300}, std::chrono::milliseconds{10000}};
    int right = r.accept_right();
    int left = r.connect_as_left();  // then nothing
    auto [ok, what] = r.result.f.get();
    EXPECT_FALSE(ok);
    EXPECT_NE(what.find("no ring data moved for 300 ms"), std::string::npos) << what;
    ::close(left);
    ::close(right);
  }
  {
    lone_ring r{std::chrono::milliseconds{300}};
    int right = r.accept_right();  // nobody connects from the left
    auto [ok, what] = r.result.f.get();
    EXPECT_FALSE(ok);
    EXPECT_NE(what.find("the previous replica did not connect within 300 ms"), std::string::npos)
        << what;
    ::close(right);
  }
}

TEST(RingPlane, AnUnreachableNeighbourIsAClearErrorAndACancelledRingEndsAtOnce) {
  test_util::watchdog dog{std::chrono::seconds{60}, "an unreachable neighbour or a cancel"};
  std::uint16_t closed_port = 0;
  {
    rp::listener gone{"127.0.0.1"};
    closed_port = gone.port();
  }  // nothing listens there now
  rp::listener port{"127.0.0.1"};
  {
    outcome result;
    rp::run run{port, spec_for(1, rp::random_key(), 0, 2, closed_port, at::ones({1024})),
                result.callback()};
    auto [ok, what] = result.f.get();
    EXPECT_FALSE(ok);
    EXPECT_NE(what.find("cannot connect to the next replica's data port 127.0.0.1:" +
                        std::to_string(closed_port)),
              std::string::npos)
        << what;
  }
  // Cancelled while it waits for a neighbour (stall limit one minute): the destructor returns
  // without the callback having run.
  rp::listener right{"127.0.0.1"};
  bool called = false;
  {
    rp::run run{port, spec_for(2, rp::random_key(), 0, 2, right.port(), at::ones({1024})),
                [&](bool, const std::string&) { called = true; }};
  }
  EXPECT_FALSE(called);
}

}  // namespace
