#include "troupe/detail/job_core.hpp"

#include <caf/actor.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>

#include "runtime_impl.hpp"
#include "troupe/detail/messages.hpp"

namespace troupe::detail {

struct job_core::actors {
  caf::actor scheduler;
  caf::actor consumer;
};

job_core::job_core(std::uint64_t id, caf::actor scheduler, caf::actor consumer)
    : id_(id), actors_(new actors{std::move(scheduler), std::move(consumer)}) {}

job_core::~job_core() = default;

const caf::actor& job_core::consumer() const noexcept {
  return actors_->consumer;
}

void job_core::finish(std::exception_ptr e) {
  std::function<void()> wake;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (finished_) return;
    finished_ = true;
    error_ = std::move(e);
    wake = on_finish_;
  }
  cv_.notify_all();
  if (wake) wake();
}

void job_core::set_progress(const progress& p) {
  std::lock_guard<std::mutex> guard{mtx_};
  progress_ = p;
}

void job_core::on_finish(std::function<void()> f) {
  std::lock_guard<std::mutex> guard{mtx_};
  on_finish_ = std::move(f);
}

bool job_core::done() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return finished_;
}

bool job_core::wait_for(std::chrono::milliseconds d) {
  std::unique_lock<std::mutex> lock{mtx_};
  return cv_.wait_for(lock, d, [this] { return finished_; });
}

void job_core::get() {
  {
    std::unique_lock<std::mutex> lock{mtx_};
    if (taken_) throw invalid_argument("job_handle::get() was called before: call it once");
    if (!finished_ && on_internal_thread())
      throw invalid_argument(
          "waiting for a job from troupe's own threads (on_progress, a producer, a consumer) "
          "would wait for itself: submit() from there and wait elsewhere");
    taken_ = true;
    cv_.wait(lock, [this] { return finished_; });
  }
  dispose();
  if (error_) std::rethrow_exception(error_);
}

void job_core::cancel() {
  if (done()) return;
  if (on_internal_thread()) {
    caf::anon_send(actors_->scheduler, cancel_atom::value, id_);
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
  if (done()) dispose();
}

void job_core::dispose() noexcept {
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (disposed_ || !actors_->consumer) return;
    disposed_ = true;
  }
  try {
    if (on_internal_thread()) {
      caf::anon_send<caf::message_priority::high>(actors_->consumer, end_atom::value);
      caf::anon_send_exit(actors_->consumer, caf::exit_reason::user_shutdown);
      return;
    }
    caf::scoped_actor self{actors_->consumer->home_system()};
    self->request<caf::message_priority::high>(actors_->consumer, caf::infinite, end_atom::value)
        .receive([](const consume_ack&) {}, [](const caf::error&) {});
    self->send_exit(actors_->consumer, caf::exit_reason::user_shutdown);
  } catch (...) {
  }
}

progress job_core::current_progress() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return progress_;
}

job_report job_core::report() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return report_;
}

std::exception_ptr job_core::error() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return error_;
}

void stream_buffer::push(batch b) {
  std::unique_lock<std::mutex> lock{mtx_};
  cv_.wait(lock, [this] { return closed_ || chunks_.size() < capacity_; });
  if (closed_) return;
  chunks_.push_back(std::move(b));
  cv_.notify_all();
}

std::optional<batch> stream_buffer::pop(const job_core& job) {
  std::unique_lock<std::mutex> lock{mtx_};
  for (;;) {
    if (!chunks_.empty()) {
      auto b = std::move(chunks_.front());
      chunks_.pop_front();
      cv_.notify_all();
      return b;
    }
    if (closed_ || job.done()) return std::nullopt;
    cv_.wait(lock);
  }
}

void stream_buffer::close() {
  {
    std::lock_guard<std::mutex> guard{mtx_};
    closed_ = true;
    chunks_.clear();
  }
  cv_.notify_all();
}

void stream_buffer::notify() {
  std::lock_guard<std::mutex> guard{mtx_};
  cv_.notify_all();
}

}  // namespace troupe::detail
