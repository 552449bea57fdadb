#include "troupe/detail/job_core.hpp"

#include <algorithm>
#include <caf/actor.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <thread>

#include "runtime_impl.hpp"
#include "troupe/device_binding.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

struct job_core::actors {
  caf::actor scheduler;
  caf::actor consumer;
};

std::optional<std::chrono::milliseconds> finite_wait(std::chrono::milliseconds d) noexcept {
  // Beyond ~100 years a steady_clock reading plus `d` would overflow its nanoseconds.
  constexpr auto forever = std::chrono::hours{24 * 365 * 100};
  if (d >= forever) return std::nullopt;
  return d;
}

job_core::job_core(std::uint64_t id, caf::actor scheduler)
    : id_(id), actors_(new actors{std::move(scheduler), caf::actor{}}) {}

job_core::~job_core() = default;

const caf::actor& job_core::consumer() const noexcept {
  return actors_->consumer;
}

void job_core::set_consumer(caf::actor consumer) {
  actors_->consumer = std::move(consumer);
}

void job_core::finish(std::exception_ptr e) {
  std::function<void()> wake;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (finished_) return;
    finished_ = true;
    ended_.store(true, std::memory_order_release);
    error_ = std::move(e);
    wake = std::move(on_finish_);  // runs once; what it holds (a then()'s handle) goes with it
    on_finish_ = nullptr;
  }
  cv_.notify_all();
  if (wake) wake();
}

void job_core::set_progress(const progress& p) {
  std::lock_guard<std::mutex> guard{mtx_};
  progress_ = p;
}

void job_core::on_finish(std::function<void()> f) {
  std::unique_lock<std::mutex> lock{mtx_};
  if (finished_) {  // it has ended already: now, on the caller's thread
    lock.unlock();
    f();
    return;
  }
  if (!on_finish_) {
    on_finish_ = std::move(f);
    return;
  }
  on_finish_ = [first = std::move(on_finish_), then = std::move(f)] {
    first();
    then();
  };
}

void job_core::detach_actors() noexcept {
  take_back_range();  // nothing reads the caller's range any more
  dispose();
  std::lock_guard<std::mutex> guard{mtx_};
  actors_->scheduler = nullptr;
  actors_->consumer = nullptr;
  disposed_ = true;
}

bool job_core::done() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return finished_;
}

bool job_core::drive(const std::function<bool()>& until) const {
  if (!driver_) return false;
  driver_(until, std::chrono::nanoseconds::max());
  return true;
}

void job_core::refuse_internal_wait(const char* what) const {
  if (!ended_.load() && on_internal_thread())
    throw invalid_argument(std::string{what} +
                           " on troupe's own threads (on_progress, a producer, a consumer) "
                           "would wait for itself and hold up every job: submit() from there "
                           "and wait elsewhere");
}

void job_core::drive_to_end(const char* what) {
  if (!driver_ || ended_.load()) return;
  refuse_internal_wait(what);
  driver_([this] { return ended_.load(); }, std::chrono::nanoseconds::max());
  if (ended_.load()) return;
  // A hang: the job is withdrawn as far as the simulation can still run (its lent range is
  // never read again), and the caller hears why.
  if (actors_->scheduler) caf::anon_send(actors_->scheduler, cancel_atom::value, id_);
  driver_([this] { return ended_.load(); }, std::chrono::nanoseconds::max());
  take_back_range();
  dispose();
  throw testing::hang(std::string{what} + ": job " + std::to_string(id_) +
                      " cannot end: the simulation has nothing left to run (or passed its "
                      "time limit) and the job is still running; see simulation::trace()");
}

bool job_core::wait_for(std::chrono::milliseconds d) {
  if (driver_) {
    if (ended_.load() || d.count() <= 0) return ended_.load();
    refuse_internal_wait("job_handle::wait_for()");
    auto limit = finite_wait(d);
    driver_([this] { return ended_.load(); },
            limit ? std::chrono::nanoseconds{*limit} : std::chrono::nanoseconds::max());
    return ended_.load();
  }
  std::unique_lock<std::mutex> lock{mtx_};
  if (finished_) return true;
  if (d.count() <= 0) return false;
  if (on_internal_thread())
    throw invalid_argument(
        "job_handle::wait_for() on troupe's own threads (on_progress, a producer, a consumer) "
        "would wait for itself and hold up every job: submit() from there and wait elsewhere");
  auto limit = finite_wait(d);
  if (!limit) {
    cv_.wait(lock, [this] { return finished_; });
    return true;
  }
  return cv_.wait_for(lock, *limit, [this] { return finished_; });
}

std::atomic<int> job_core::spinners{0};

int job_core::max_spinners() {
  static const int n = std::max(1, usable_cores() / 2);
  return n;
}

void job_core::get() {
  if (!taken_) drive_to_end("job_handle::get()");
  {
    std::unique_lock<std::mutex> lock{mtx_};
    if (taken_) throw invalid_argument("job_handle::get() was called before: call it once");
    if (!finished_ && on_internal_thread())
      throw invalid_argument(
          "waiting for a job from troupe's own threads (on_progress, a producer, a consumer) "
          "would wait for itself: submit() from there and wait elsewhere");
    taken_ = true;
    if (!finished_) {
      // A short job ends within microseconds: look for it a while, giving the core to the
      // job's threads, before sleeping (a futex wake-up across cores costs ~20 us on a VM). At
      // most half the cores' worth of callers look at once: many callers spinning on few cores
      // would keep troupe's own threads (the scheduler, producers) waiting for one.
      if (spinners.fetch_add(1, std::memory_order_relaxed) < max_spinners()) {
        lock.unlock();
        auto until = std::chrono::steady_clock::now() + spin_before_sleep;
        while (!ended_.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < until)
          std::this_thread::yield();
        lock.lock();
      }
      spinners.fetch_sub(1, std::memory_order_relaxed);
    }
    cv_.wait(lock, [this] { return finished_; });
  }
  take_back_range();
  dispose();
  if (error_) std::rethrow_exception(error_);
}

void job_core::take_back_range() noexcept {
  if (!lease_) return;
  try {
    lease_->revoke_and_wait();
  } catch (...) {
  }
}

void job_core::cancel() {
  if (done()) return;
  if (driver_ && !actors_->scheduler) return;  // its simulation has ended
  if (on_internal_thread() || driver_) {
    caf::anon_send(actors_->scheduler, cancel_atom::value, id_);
    if (driver_ && !on_internal_thread()) drive_to_end("job_handle::cancel()");
    return;
  }
  try {
    caf::scoped_actor self{actors_->scheduler->home_system()};
    self->request(actors_->scheduler, caf::infinite, cancel_atom::value, id_)
        .receive([](const consume_ack&) {}, [](const caf::error&) {});
  } catch (...) {
  }
  // The scheduler has withdrawn the job (or had closed: then it ended it with runner_closed).
}

void job_core::abandon() noexcept {
  try {
    cancel();
  } catch (...) {
  }
  // The range goes back now, whether or not the job has ended yet: on troupe's own threads
  // cancel() only sends the cancel, and a cancel that comes while consumer::end() runs is
  // refused; either way a producer (a speculative copy, say) may still be working on a chunk
  // of it. Revoked, the lease lets no block be copied any more; this waits for one under way.
  take_back_range();
  if (done()) dispose();
}

void job_core::dispose() noexcept {
  gate_->stop();  // a chunk the consumer is working on stops at its next item
  caf::actor consumer;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (disposed_ || !actors_->consumer) return;
    disposed_ = true;
    consumer = std::move(actors_->consumer);
    actors_->consumer = nullptr;
  }
  if (gate_->ending()) return;  // consumer::end() has begun: the consumer ends itself after it
  try {
    // Nothing waits for the consumer: it may be inside a long work() call. The high-priority
    // message overtakes the chunks still queued for it; the exit ends the actor after it.
    caf::anon_send<caf::message_priority::high>(consumer, end_atom::value);
    caf::anon_send_exit(consumer, caf::exit_reason::user_shutdown);
  } catch (...) {
  }
}

progress job_core::current_progress() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return progress_;
}

job_report job_core::report() const {
  std::lock_guard<std::mutex> guard{mtx_};
  auto r = report_;
  r.delivered = gate_->delivered();  // counted by the consumer, also after a cancel
  return r;
}

std::exception_ptr job_core::error() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return error_;
}

bool stream_buffer::push(batch b) {
  std::lock_guard<std::mutex> guard{mtx_};
  if (closed_) return true;
  chunks_.push_back(std::move(b));
  cv_.notify_all();
  if (chunks_.size() <= capacity_) return true;
  waiting_ = true;
  return false;
}

bool stream_buffer::room_or_wait() {
  std::lock_guard<std::mutex> guard{mtx_};
  if (closed_ || chunks_.size() < capacity_) return true;
  waiting_ = true;
  return false;
}

void stream_buffer::on_room(std::function<void()> f) {
  std::lock_guard<std::mutex> guard{mtx_};
  on_room_ = std::move(f);
}

std::optional<batch> stream_buffer::pop(const job_core& job) {
  std::function<void()> wake;
  std::optional<batch> out;
  {
    std::unique_lock<std::mutex> lock{mtx_};
    for (;;) {
      if (closed_) return std::nullopt;
      if (!chunks_.empty()) {
        out = std::move(chunks_.front());
        chunks_.pop_front();
        if (waiting_ && chunks_.size() < capacity_) {
          waiting_ = false;
          wake = on_room_;
        }
        break;
      }
      if (job.done()) return std::nullopt;
      if (!job.simulated()) {
        cv_.wait(lock);
        continue;
      }
      lock.unlock();
      job.drive([this, &job] {
        std::lock_guard<std::mutex> guard{mtx_};
        return closed_ || !chunks_.empty() || job.done();
      });
      lock.lock();
      if (!closed_ && chunks_.empty() && !job.done()) {
        throw testing::hang("output_stream: job " + std::to_string(job.id()) +
                            " cannot go on: the simulation has nothing left to run (or passed "
                            "its time limit); see simulation::trace()");
      }
    }
  }
  if (wake) wake();  // outside the lock: it sends a message to the consumer actor
  return out;
}

void stream_buffer::close() {
  std::function<void()> drop;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    closed_ = true;
    chunks_.clear();
    drop = std::move(on_room_);
    on_room_ = nullptr;
  }
  cv_.notify_all();
}

void stream_buffer::cancel() {
  {
    std::lock_guard<std::mutex> guard{mtx_};
    cancelled_ = true;
  }
  close();
}

bool stream_buffer::cancelled() {
  std::lock_guard<std::mutex> guard{mtx_};
  return cancelled_;
}

void stream_buffer::notify() {
  std::lock_guard<std::mutex> guard{mtx_};
  cv_.notify_all();
}

}  // namespace troupe::detail
