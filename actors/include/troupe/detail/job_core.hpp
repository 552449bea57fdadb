// The shared state of one job: between the scheduler that runs it and the job_handle or
// output_stream that waits for it.
#pragma once

#include <atomic>
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
#include <stdexcept>

#include "troupe/batch.hpp"
#include "troupe/detail/job_gate.hpp"
#include "troupe/job_options.hpp"
#include "troupe/options.hpp"

namespace troupe::testing {

/// A simulated cluster (troupe::testing::simulation) went idle, or past its virtual time
/// limit, while a job it was asked to finish had not ended: the job can never end (a hang).
/// Its what() names the job and the virtual time; simulation::trace() has every event.
class hang : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace troupe::testing

namespace troupe::detail {

/// True on a thread that runs troupe's actors (see runtime.hpp).
bool on_internal_thread() noexcept;

class job_core {
 public:
  job_core(std::uint64_t id, caf::actor scheduler);
  ~job_core();
  job_core(const job_core&) = delete;
  job_core& operator=(const job_core&) = delete;

  [[nodiscard]] std::uint64_t id() const noexcept { return id_; }
  /// Set once, before the job reaches the scheduler.
  void set_id(std::uint64_t id) noexcept { id_ = id; }
  [[nodiscard]] const caf::actor& consumer() const noexcept;
  /// Set once, before the job reaches the scheduler.
  void set_consumer(caf::actor consumer);
  [[nodiscard]] const std::shared_ptr<job_gate>& gate() const noexcept { return gate_; }
  /// The lease of the caller's range lent to the producers, if any: get() and abandon() take
  /// it back before they return.
  void set_lease(std::shared_ptr<range_lease> lease) { lease_ = std::move(lease); }

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
  /// Called once the job has ended (a stream's reader waits on its own buffer), on the thread
  /// that ends it, or at once on the caller's thread when it has ended already; each call adds
  /// one.
  void on_finish(std::function<void()> f);
  /// Its simulation is ending: the consumer is let go and no message is sent to the
  /// simulation's actors any more (the handle may outlive them).
  void detach_actors() noexcept;

  /// A job of a simulated cluster: `drive(until)` runs the simulation on the calling thread
  /// until `until()` holds or nothing more can happen, in place of every wait below.
  /// `at_most`: virtual time it may advance, at most (nanoseconds::max(): no limit).
  using driver =
      std::function<void(const std::function<bool()>& until, std::chrono::nanoseconds at_most)>;
  /// Set once, before the job reaches the scheduler.
  void set_driver(driver d) { driver_ = std::move(d); }
  /// Runs the simulation until `until()` holds (nothing without one); false without one.
  bool drive(const std::function<bool()>& until) const;
  [[nodiscard]] bool simulated() const noexcept { return static_cast<bool>(driver_); }

  // -- the caller's side --------------------------------------------------------------------

  [[nodiscard]] bool done() const;
  /// done(), without the lock (for observers).
  [[nodiscard]] bool ended() const noexcept { return ended_.load(std::memory_order_acquire); }
  /// Throws invalid_argument on troupe's own threads for an unfinished job and a wait longer
  /// than zero (it would wait for itself). milliseconds::max() waits forever.
  [[nodiscard]] bool wait_for(std::chrono::milliseconds d);
  /// Waits for the end, lets the consumer go (no member of it starts afterwards; a work() call
  /// of a cancelled job may still be finishing its item), and rethrows the job's error.
  /// Throws invalid_argument on troupe's own threads (it would wait for itself) and when called
  /// a second time.
  void get();
  /// Ends the job (cancelled) unless it has ended; returns once the scheduler has withdrawn
  /// its items (at once on troupe's own threads).
  void cancel();
  /// The handle is going away: cancels an unfinished job and disposes of its consumer.
  void abandon() noexcept;
  /// Ends the consumer actor without waiting for it: a high-priority message overtakes chunks
  /// still queued for it, and the gate stops the chunk it may be working on. Idempotent.
  void dispose() noexcept;
  [[nodiscard]] progress current_progress() const;
  [[nodiscard]] job_report report() const;
  /// The job's error, if it ended with one.
  [[nodiscard]] std::exception_ptr error() const;

 private:
  struct actors;  ///< the scheduler and the job's consumer (job_core.cpp)
  std::uint64_t id_;
  std::unique_ptr<actors> actors_;
  std::shared_ptr<job_gate> gate_ = std::make_shared<job_gate>();
  std::shared_ptr<range_lease> lease_;
  /// Nobody reads the caller's range any more (a producer finishes its block of items).
  void take_back_range() noexcept;
  mutable std::mutex mtx_;
  std::condition_variable cv_;
  bool finished_ = false;
  std::atomic<bool> ended_{false};  ///< finished_, for get()'s look before it sleeps
  static constexpr std::chrono::microseconds spin_before_sleep{200};
  static std::atomic<int> spinners;  ///< callers in get() looking for their job's end now
  static int max_spinners();         ///< half the cores, at least one
  bool taken_ = false;
  bool disposed_ = false;
  std::exception_ptr error_;
  progress progress_;
  job_report report_;
  std::function<void()> on_finish_;
  driver driver_;
  /// Simulated: runs the simulation until the job has ended; throws testing::hang if it cannot
  /// (the job withdrawn first).
  void drive_to_end(const char* what);
  /// Throws invalid_argument for a wait on troupe's own threads on a job still running.
  void refuse_internal_wait(const char* what) const;
};

/// The buffer between a stream's consumer actor and the thread reading the stream. The actor
/// never waits on it: a chunk pushed beyond `capacity` is kept, and its acknowledgement is held
/// back until the reader has made room (`on_room`), so the scheduler's consumer_backlog pauses
/// the job's dispatch. It holds at most capacity + options::consumer_backlog chunks (each at
/// most options::max_chunk_bytes).
class stream_buffer {
 public:
  explicit stream_buffer(std::size_t capacity) : capacity_(capacity) {}
  /// Consumer side, never blocks: true when there is room after it (acknowledge now); dropped
  /// once closed (true).
  bool push(batch b);
  /// Consumer side: whether there is room now; when there is not, the next pop that makes room
  /// calls on_room (so a chunk held back is taken even when a room message found the buffer
  /// filled again by a chunk that came before it).
  [[nodiscard]] bool room_or_wait();
  /// Called (on the reader's thread) when a pop makes room while pushes wait for it.
  void on_room(std::function<void()> f);
  /// Reader side: the next chunk, or nothing once the buffer is empty and the job has ended, or
  /// once it is closed.
  std::optional<batch> pop(const job_core& job);
  /// Nothing more is kept; a waiting reader wakes up.
  void close();
  /// close() by output_stream::cancel(): the reader's loop ends without an error.
  void cancel();
  [[nodiscard]] bool cancelled();
  void notify();

 private:
  std::mutex mtx_;
  std::condition_variable cv_;
  std::deque<batch> chunks_;
  std::size_t capacity_;
  std::function<void()> on_room_;
  bool waiting_ = false;  ///< a push found it full and waits for on_room
  bool closed_ = false;
  bool cancelled_ = false;
};

}  // namespace troupe::detail
