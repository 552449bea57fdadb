// troupe::job_handle and troupe::output_stream: a job submitted to a runner, waited for as a
// whole or read as it comes (docs/api.md, "One pool, many jobs").
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "troupe/detail/job_core.hpp"
#include "troupe/error.hpp"
#include "troupe/job_options.hpp"
#include "troupe/log.hpp"
#include "troupe/outcome.hpp"

namespace troupe {

/// A job running on a runner's producers. Movable, not copyable. Destroying the handle of an
/// unfinished job cancels it.
template <class R>
class job_handle {
 public:
  job_handle() = default;
  job_handle(std::shared_ptr<detail::job_core> core, std::shared_ptr<std::optional<R>> slot)
      : core_(std::move(core)), slot_(std::move(slot)) {}
  job_handle(job_handle&&) noexcept = default;
  job_handle& operator=(job_handle&& other) noexcept {
    if (this != &other) {
      release();
      core_ = std::move(other.core_);
      slot_ = std::move(other.slot_);
    }
    return *this;
  }
  job_handle(const job_handle&) = delete;
  job_handle& operator=(const job_handle&) = delete;
  ~job_handle() { release(); }

  /// Waits for the job; returns consumer::end() (or the outputs, for a job without consumer).
  /// Throws what run() throws, or cancelled / deadline_exceeded. Call it once. It does not wait
  /// for a busy consumer: when it returns or throws, no member of the job's consumer starts
  /// any more (a work() call under way may finish its item in the background). A range lent
  /// to the job (an lvalue) is no longer read.
  R get() {
    if (!core_) throw invalid_argument("get() on an empty or moved-from job_handle");
    core_->get();
    return std::move(**slot_);
  }
  /// Instead of get(), without a blocked thread: once the job has ended, `f(outcome<R>)` runs
  /// exactly once (the value, or the exception get() would throw), handed to `post` (any
  /// callable taking a std::function<void()>: the application's executor). At once (handed to
  /// `post`) when the job has ended already. The handle is empty afterwards; the job runs on
  /// (dropping the handle no longer cancels it; cancel() before then() if needed). No thread
  /// waits for a pending then().
  template <class Post, class F>
  void then(Post post, F f) {
    auto core = take_core("then()");
    auto slot = std::move(slot_);
    auto* c = core.get();
    // Held by shared_ptr: `f` and `post` may be move-only (an Asio completion handler).
    c->on_finish([core = std::move(core), slot = std::move(slot),
                  post = std::make_shared<Post>(std::move(post)),
                  f = std::make_shared<F>(std::move(f))]() mutable {
      outcome<R> o;
      try {
        core->get();
        o.value.emplace(std::move(**slot));
      } catch (...) {
        o.error = std::current_exception();
      }
      core.reset();
      slot.reset();
      try {
        (*post)(std::function<void()>{[f = std::move(f), o = std::make_shared<outcome<R>>(std::move(
                                                             o))] { (*f)(std::move(*o)); }});
      } catch (...) {  // the executor refused it (stopped): nothing else can run f
        log(log_level::error, "job_handle::then(): `post` threw; the callback will not run");
      }
    });
  }
  /// then() without an executor: `f` runs on the thread that ends the job (one of troupe's:
  /// keep it short, and do not wait there for other jobs), or at once on this thread when the
  /// job has ended already.
  template <class F>
  void then(F f) {
    then(
        [](std::function<void()> g) {
          try {
            g();
          } catch (const std::exception& e) {  // not into troupe's actor: the job is over
            log(log_level::error,
                std::string{"job_handle::then(): the callback threw: "} + e.what());
          } catch (...) {
            log(log_level::error, "job_handle::then(): the callback threw");
          }
        },
        std::move(f));
  }

  /// True once the job has ended (any way). milliseconds::max() waits forever; on troupe's own
  /// threads a wait longer than 0 for an unfinished job throws invalid_argument.
  bool wait_for(std::chrono::milliseconds d) { return core().wait_for(d); }
  [[nodiscard]] bool done() const { return core().done(); }
  /// Ends the job unless it has ended: no further item of it reaches a producer, results in
  /// flight are dropped, get() throws cancelled. Idempotent.
  void cancel() { core().cancel(); }
  [[nodiscard]] troupe::progress progress() const { return core().current_progress(); }
  /// A callable that cancels the job (as cancel()) while it runs, valid after the handle has
  /// moved or gone (then()); it does nothing once the job's state is gone.
  [[nodiscard]] std::function<void()> canceller() const {
    return [w = std::weak_ptr<detail::job_core>(core_)] {
      if (auto c = w.lock()) c->cancel();
    };
  }
  /// Complete once done().
  [[nodiscard]] job_report report() const { return core().report(); }
  [[nodiscard]] bool valid() const noexcept { return core_ != nullptr; }

 private:
  std::shared_ptr<detail::job_core> take_core(const char* what) {
    if (!core_) throw invalid_argument(std::string{what} + " on an empty or moved-from job_handle");
    return std::move(core_);
  }
  detail::job_core& core() const {
    if (!core_) throw invalid_argument("an empty or moved-from job_handle");
    return *core_;
  }
  void release() noexcept {
    if (core_) core_->abandon();
    core_.reset();
  }

  std::shared_ptr<detail::job_core> core_;
  std::shared_ptr<std::optional<R>> slot_;
};

/// The outputs of a job as they come (an ordered runner gives them in input order), with a
/// bounded buffer: when the reader is slow the producers pause. An input range: iterate it
/// once. Leaving the loop early or destroying the stream cancels the rest of the job; an error
/// of the job is thrown by the iteration, after the outputs that reached the buffer before it.
template <class T>
class output_stream {
 public:
  struct sentinel {};
  class iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = T;
    using difference_type = std::ptrdiff_t;
    using pointer = T*;
    using reference = T&;

    iterator() = default;
    explicit iterator(output_stream* s) : s_(s) {}
    T& operator*() const { return s_->current(); }
    T* operator->() const { return &s_->current(); }
    iterator& operator++() {
      s_->advance();
      return *this;
    }
    void operator++(int) { s_->advance(); }
    friend bool operator==(const iterator& i, sentinel) { return !i.s_ || i.s_->at_end(); }
    friend bool operator!=(const iterator& i, sentinel s) { return !(i == s); }
    friend bool operator==(sentinel s, const iterator& i) { return i == s; }
    friend bool operator!=(sentinel s, const iterator& i) { return !(i == s); }

   private:
    output_stream* s_ = nullptr;
  };

  output_stream(std::shared_ptr<detail::job_core> core, std::shared_ptr<detail::stream_buffer> buf)
      : core_(std::move(core)), buf_(std::move(buf)) {}
  output_stream(output_stream&&) noexcept = default;
  output_stream& operator=(output_stream&&) = delete;
  output_stream(const output_stream&) = delete;
  output_stream& operator=(const output_stream&) = delete;
  ~output_stream() {
    if (core_) {
      buf_->close();
      core_->abandon();
    }
  }

  /// Waits for the first output.
  iterator begin() {
    if (!ended_ && detail::on_internal_thread())
      throw invalid_argument(
          "reading a stream on troupe's own threads (on_progress, a producer, a consumer) "
          "would wait for itself");
    fetch();
    return iterator{this};
  }
  sentinel end() const noexcept { return {}; }
  /// Ends the job; the iteration ends, without an error, after the output it is on. Safe from
  /// any thread: a reader waiting for the next output wakes up and its loop ends.
  void cancel() {
    buf_->cancel();
    core_->cancel();
  }
  [[nodiscard]] job_report report() const { return core_->report(); }
  [[nodiscard]] troupe::progress progress() const { return core_->current_progress(); }

  // The iterator's steps (an input range has one position: the stream's).
  T& current() {
    if constexpr (std::is_same_v<T, bool>) {  // a std::vector<bool> has no bool& to give
      current_bool_ = items()->items[pos_];
      return current_bool_;
    } else {
      return items()->items[pos_];
    }
  }
  [[nodiscard]] bool at_end() const noexcept { return ended_; }
  void advance() {
    ++pos_;
    if (!ended_ && buf_->cancelled()) {  // cancel(), here or from another thread
      finish_cancelled();
      return;
    }
    fetch();
  }

 private:
  batch_of<T>* items() const { return chunk_.template as<T>(); }
  /// Moves to the next output, waiting for it; at the end, rethrows the job's error.
  void fetch() {
    if (ended_) return;
    while (!items() || pos_ >= items()->items.size()) {
      auto next = buf_->pop(*core_);
      if (!next) {
        if (buf_->cancelled()) {
          finish_cancelled();
          return;
        }
        ended_ = true;
        chunk_ = batch{};
        buf_->close();  // the stream's consumer never waits for the reader
        core_->get();   // lets the consumer go; throws the job's error
        return;
      }
      chunk_ = std::move(*next);
      pos_ = 0;
    }
  }

  /// The loop ends quietly after cancel() (only the reader's thread writes ended_).
  void finish_cancelled() {
    ended_ = true;
    chunk_ = batch{};
    core_->cancel();
    core_->dispose();
  }

  std::shared_ptr<detail::job_core> core_;
  std::shared_ptr<detail::stream_buffer> buf_;
  batch chunk_;
  std::size_t pos_ = 0;
  bool ended_ = false;
  bool current_bool_ = false;  ///< T = bool: the output the iterator is on
};

}  // namespace troupe
