// What a job's consumer and the code that ends the job share without waiting for each other.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>

namespace troupe::detail {

/// A wait of `d`, where durations too long to add to a clock reading (such as
/// milliseconds::max()) mean "forever": nothing when it is that long.
std::optional<std::chrono::milliseconds> finite_wait(std::chrono::milliseconds d) noexcept;

/// What a job's consumer and whoever ends the job agree on, without waiting for each other.
/// A consumer checks `stopped()` before every item and gives up the rest of its chunk once the
/// job has ended; consumer::end() runs only after `begin_end()` won against `stop()`, so that a
/// cancel or deadline either comes first (end() never starts) or loses (end()'s value is the
/// job's result).
class job_gate {
 public:
  /// The consumer is about to call consumer::end(): false when the job has ended already.
  bool begin_end() noexcept {
    int open = state_open;
    return state_.compare_exchange_strong(open, state_ending, std::memory_order_acq_rel);
  }
  /// The job ends without consumer::end(): false when end() has begun (its value will come).
  bool stop() noexcept {
    int open = state_open;
    return state_.compare_exchange_strong(open, state_stopped, std::memory_order_acq_rel) ||
           state_.load(std::memory_order_acquire) == state_stopped;
  }
  /// consumer::end() has begun: the consumer ends itself after it.
  [[nodiscard]] bool ending() const noexcept {
    return state_.load(std::memory_order_acquire) == state_ending;
  }
  /// Neither ended nor ending: its outputs are still wanted (a producer folding a chunk for
  /// it goes on; once end() has begun, what is still being folded is a copy that lost).
  [[nodiscard]] bool open() const noexcept {
    return state_.load(std::memory_order_relaxed) == state_open;
  }
  [[nodiscard]] bool stopped() const noexcept {
    return state_.load(std::memory_order_relaxed) == state_stopped;
  }
  /// Outputs the consumer (or the stream's buffer) has taken, counted by the consumer itself.
  void add_delivered(std::uint64_t n) noexcept {
    delivered_.fetch_add(n, std::memory_order_relaxed);
  }
  [[nodiscard]] std::uint64_t delivered() const noexcept {
    return delivered_.load(std::memory_order_relaxed);
  }
  /// The consumer has taken a chunk (its items counted by add_delivered before; the job's last
  /// chunk: once consumer::end() has returned). It acknowledges a chunk with a message only
  /// when this says so (the scheduler waits for it) and for the last chunk: the scheduler reads
  /// chunks_done and delivered at a producer's answer or on a timer, so that a chunk costs no
  /// wake-up of the scheduler's thread. Sequentially consistent with want_ack: either the
  /// consumer sees the wish or the scheduler sees the chunk; a reader of chunks_done sees the
  /// items delivered before it.
  bool chunk_done() noexcept {
    chunks_done_.fetch_add(1, std::memory_order_seq_cst);
    return ack_wanted_.load(std::memory_order_seq_cst);
  }
  [[nodiscard]] std::uint64_t chunks_done() const noexcept {
    return chunks_done_.load(std::memory_order_seq_cst);
  }
  /// The scheduler waits for the consumer (or no longer does): the next chunk_done() says so.
  void want_ack(bool yes) noexcept { ack_wanted_.store(yes, std::memory_order_seq_cst); }

  /// Set before the job starts: called by the consumer once consumer::end() has returned after
  /// the job's last outputs (the job has succeeded; the scheduler learns it after the caller).
  std::function<void()> succeeded;

 private:
  static constexpr int state_open = 0;
  static constexpr int state_ending = 1;
  static constexpr int state_stopped = 2;
  std::atomic<int> state_{state_open};
  std::atomic<std::uint64_t> delivered_{0};
  std::atomic<std::uint64_t> chunks_done_{0};
  std::atomic<bool> ack_wanted_{false};
};

}  // namespace troupe::detail
