// The shared state of one job: between the scheduler that runs it and the job_handle or
// output_stream that waits for it.
#pragma once

#include <caf/fwd.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>

#include "troupe/batch.hpp"
#include "troupe/job_options.hpp"
#include "troupe/options.hpp"

namespace troupe::detail {

/// True on a thread that runs troupe's actors (see runtime.hpp).
bool on_internal_thread() noexcept;

class job_core {
 public:
  job_core(std::uint64_t id, caf::actor scheduler, caf::actor consumer);
  ~job_core();
  job_core(const job_core&) = delete;
  job_core& operator=(const job_core&) = delete;

  [[nodiscard]] std::uint64_t id() const noexcept { return id_; }
  [[nodiscard]] const caf::actor& consumer() const noexcept;

  // -- the scheduler's side ---------------------------------------------------------------

  /// The job has ended (e: nullptr on success). Wakes every waiter.
  void finish(std::exception_ptr e);
  void set_progress(const progress& p);
  /// Runs `f` on the report under the lock (the scheduler keeps it current).
  template <class F>
  void update_report(F&& f) {
    std::lock_guard<std::mutex> guard{mtx_};
    f(report_);
  }
  /// Called once the job has ended (a stream's reader waits on its own buffer).
  void on_finish(std::function<void()> f);

  // -- the caller's side --------------------------------------------------------------------

  [[nodiscard]] bool done() const;
  [[nodiscard]] bool wait_for(std::chrono::milliseconds d);
  /// Waits for the end, disposes of the consumer (none of its members runs afterwards), and
  /// rethrows the job's error. Throws invalid_argument on troupe's own threads (it would wait
  /// for itself) and when called a second time.
  void get();
  /// Ends the job (cancelled) unless it has ended; returns once the scheduler has withdrawn
  /// its items (at once on troupe's own threads).
  void cancel();
  /// The handle is going away: cancels an unfinished job and disposes of its consumer.
  void abandon() noexcept;
  /// Ends the consumer actor: a high-priority message overtakes chunks still queued for it.
  /// Idempotent.
  void dispose() noexcept;
  [[nodiscard]] progress current_progress() const;
  [[nodiscard]] job_report report() const;
  /// The job's error, if it ended with one.
  [[nodiscard]] std::exception_ptr error() const;

 private:
  struct actors;  ///< the scheduler and the job's consumer (job_core.cpp)
  std::uint64_t id_;
  std::unique_ptr<actors> actors_;
  mutable std::mutex mtx_;
  std::condition_variable cv_;
  bool finished_ = false;
  bool taken_ = false;
  bool disposed_ = false;
  std::exception_ptr error_;
  progress progress_;
  job_report report_;
  std::function<void()> on_finish_;
};

/// The bounded buffer between a stream's consumer actor and the thread reading the stream.
/// Its capacity in chunks (each at most options::max_chunk_bytes) bounds the stream's memory:
/// when it is full the consumer actor waits, its backlog fills, and dispatch pauses.
class stream_buffer {
 public:
  explicit stream_buffer(std::size_t capacity) : capacity_(capacity) {}
  /// Consumer side: waits while full; dropped once closed.
  void push(batch b);
  /// Reader side: the next chunk, or nothing once the buffer is empty and the job has ended.
  std::optional<batch> pop(const job_core& job);
  /// Nothing more is kept; a waiting push returns.
  void close();
  void notify();

 private:
  std::mutex mtx_;
  std::condition_variable cv_;
  std::deque<batch> chunks_;
  std::size_t capacity_;
  bool closed_ = false;
};

}  // namespace troupe::detail
