// The ring all-reduce's data plane between replicas on nodes: one TCP connection from each
// replica to the next, the gradient written straight from and read straight into its tensor
// (CAF's path copies every byte into its buffers on both sides). Membership, the ring's
// order, recovery and errors stay with the actors (train_replica_actor.cpp, train_step.cpp);
// this moves bytes only.
// Design notes and the measurements behind it: docs/api.md ("Training: data_parallel": "The ring's
// data", "How it works").
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ring_schedule.hpp"

namespace troupe::detail::ring_plane {

/// A ring's secret: 16 random bytes that the coordinator sends each member over the actors'
/// channel, and which a connection's first bytes must carry.
using key = std::array<std::uint8_t, 16>;
key random_key();
std::string to_hex(const key& k);
/// Throws std::invalid_argument unless `s` is 32 hex digits.
key from_hex(const std::string& s);

/// A replica's listening socket for its left neighbour's connection, on the host its node
/// serves on (port chosen by the system). Closed on destruction. Its runs (one at a time) accept
/// on it for as long as they last, closing strangers' connections at once, so that a flood
/// between rings can only fill the system's backlog (SOMAXCONN).
class listener {
 public:
  /// Throws std::runtime_error naming the host and the reason.
  explicit listener(const std::string& host);
  ~listener();
  listener(const listener&) = delete;
  listener& operator=(const listener&) = delete;
  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }
  [[nodiscard]] int fd() const noexcept { return fd_; }

  /// The first 32 bytes of a ring connection: magic, key, ring id.
  using hello = std::array<unsigned char, 32>;
  /// Keeps a connection whose hello names ring `id`, later than ring `current` that accepted it
  /// (the left neighbour already on the next ring), for that ring's run; its key can only be
  /// checked then. Only ids less than 2^20 ahead are kept (ring ids count up by a few per step),
  /// at most 4, the nearest ones: a stranger's hello with a later id never pushes out the next
  /// ring's. The connection is closed when it is not kept.
  void park(int fd, const hello& h, std::uint64_t id, std::uint64_t current);
  /// The connection parked with hello `h` (-1: none); parked ones of rings up to `id` that do
  /// not match are closed.
  int take_parked(const hello& h, std::uint64_t id);
  /// The reduce-scatter's receive buffer, at least `bytes` long: kept from ring to ring (a fresh
  /// one of a few MiB would pay its page faults every step). Only the running ring uses it.
  unsigned char* scratch(std::size_t bytes) {
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    return scratch_.data();
  }

 private:
  int fd_ = -1;
  std::uint16_t port_ = 0;
  struct parked {
    int fd;
    hello h;
    std::uint64_t id;
  };
  std::mutex mtx_;
  std::vector<parked> parked_;
  std::vector<unsigned char> scratch_;
};

struct spec {
  std::uint64_t id = 0;  ///< the ring's id (in the hello, with the key)
  key secret{};
  std::uint32_t pos = 0, n = 0, pieces = 1;
  std::string right_host;  ///< the next replica's node host and data port
  std::uint16_t right_port = 0;
  at::Tensor buf;  ///< this replica's partial sum (contiguous, CPU); the result replaces it
  /// Both connections (to the right neighbour, from the left one) not there this long after the
  /// start: the ring fails (a port the others cannot reach, a firewall dropping packets).
  std::chrono::milliseconds connect_deadline{5000};
  /// No byte moved for this long: the ring fails (a backstop: the coordinator gives up on a
  /// frozen replica first, and a new command cancels the ring).
  std::chrono::milliseconds stall{60000};
  /// At most this many connections waiting for their hello at once (others are closed).
  std::size_t max_pending = 16;
  /// A connection whose 32-byte hello is not complete this long after it was accepted is closed.
  std::chrono::milliseconds hello_deadline{2000};
};

/// Tests only: every run waits this long before it connects (its cancel still ends the wait at
/// once), to make a ring late on purpose. 0, the default: no wait.
extern std::atomic<int> test_delay_ms;

/// Tests only: the next this many rings started by replicas of this process (over the data
/// plane or through CAF) fail at once, as one whose neighbour cannot be reached fails; for
/// testing the coordinator's fallbacks. 0, the default: none.
extern std::atomic<int> test_fail_rings;

/// Takes one of test_fail_rings: true when this ring is to fail.
bool take_test_failure() noexcept;

/// Tests only: with TROUPE_TEST_DIE_AT_RING=N in its environment (read once), the process
/// SIGKILLs itself as a replica of it starts its N-th ring: a node that dies in the ring
/// all-reduce, at a moment a test can name. Unset, the default: never.
void die_at_test_ring() noexcept;

/// One ring all-reduce (reduce-scatter then all-gather, `pieces` slices pipelined, a fixed
/// order of messages on each connection, so nothing but the hello travels besides the data),
/// on a thread of its own. At the end `done(ok, what)` is called on that thread, unless the
/// run was cancelled first. Destruction cancels (promptly: every wait polls a wake-up fd) and
/// joins.
class run {
 public:
  run(listener& l, spec s, std::function<void(bool, const std::string&)> done);
  ~run();
  run(const run&) = delete;
  run& operator=(const run&) = delete;

 private:
  void body();
  void loop();
  listener& l_;
  spec s_;
  std::function<void(bool, const std::string&)> done_;
  int wake_ = -1;  ///< an eventfd
  std::atomic<bool> cancelled_{false};
  std::thread thread_;
};

}  // namespace troupe::detail::ring_plane
