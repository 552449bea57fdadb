// troupe::async_get: a job's result through any Boost.Asio completion token (docs/api.md,
// "Embedding in applications"). Header-only and optional: Boost.Asio from Debian's
// libboost1.81-dev; C++20 for co_await with asio::use_awaitable (use_future, deferred and plain
// callbacks work in C++17). troupe's own package does not depend on Boost.
#pragma once

#include <atomic>
#include <boost/asio/associated_cancellation_slot.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/execution/context.hpp>
#include <boost/asio/execution_context.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/query.hpp>
#include <boost/asio/system_executor.hpp>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>

#include "troupe/job_handle.hpp"

namespace troupe {

namespace detail {

/// Keeps an execution context's thread awake a short while after an async_get, as get() spins
/// before it sleeps: a 1-item job ends within tens of microseconds, and waking a sleeping event
/// loop (a futex, then a core for it) costs about as much again. While awaited jobs are pending
/// and the last async_get on this context is younger than the spin, one "watcher" handler
/// re-posts itself, yielding the core between turns; other handlers run between its turns, and
/// a completion posted meanwhile needs no wake-up. At most one watcher per context.
class completion_spin final : public boost::asio::execution_context::service {
 public:
  using key_type = completion_spin;
  static inline boost::asio::execution_context::id id;

  explicit completion_spin(boost::asio::execution_context& ctx)
      : boost::asio::execution_context::service(ctx) {}

  void set(std::chrono::nanoseconds spin) { spin_ns_.store(spin.count()); }

  /// An async_get began: its completion is pending.
  template <class Executor>
  void started(const Executor& ex) {
    auto spin = spin_ns_.load(std::memory_order_relaxed);
    pending_.fetch_add(1, std::memory_order_relaxed);
    if (spin <= 0) return;
    until_ns_.store(now_ns() + spin, std::memory_order_relaxed);
    if (!watching_.exchange(true)) watch(ex);
  }

  /// Its completion has been posted.
  void ended() { pending_.fetch_sub(1, std::memory_order_release); }

 private:
  static std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  bool keep_watching() const {
    return pending_.load(std::memory_order_acquire) > 0 &&
           now_ns() < until_ns_.load(std::memory_order_relaxed);
  }
  template <class Executor>
  void watch(const Executor& ex) {
    boost::asio::post(ex, [this, ex] {
      if (keep_watching()) {
        std::this_thread::yield();
        watch(ex);
        return;
      }
      watching_.store(false);
      // An async_get that came as this watcher stopped would otherwise go unwatched.
      if (keep_watching() && !watching_.exchange(true)) watch(ex);
    });
  }
  void shutdown() override {}

  std::atomic<int> pending_{0};
  std::atomic<std::int64_t> until_ns_{0};
  std::atomic<std::int64_t> spin_ns_{200'000};
  std::atomic<bool> watching_{false};
};

/// The context behind an executor, when it has one that can hold a service.
template <class Executor>
completion_spin* spin_of(const Executor& ex) {
  namespace net = boost::asio;
  if constexpr (std::is_same<Executor, net::system_executor>::value) {
    return nullptr;
  } else if constexpr (net::can_query<const Executor&, net::execution::context_t>::value) {
    auto& ctx = net::query(ex, net::execution::context);
    if constexpr (std::is_convertible<decltype(ctx), net::execution_context&>::value)
      return &net::use_service<completion_spin>(static_cast<net::execution_context&>(ctx));
    else
      return nullptr;
  } else {
    return nullptr;
  }
}

}  // namespace detail

/// How long async_get keeps `ctx`'s thread awake (yielding its core) after the last async_get
/// whose handler runs there, while awaited jobs are pending: 200 us by default, as get() spins
/// before it sleeps; zero lets the thread sleep at once (every completion then wakes it).
inline void set_completion_spin(boost::asio::execution_context& ctx,
                                std::chrono::microseconds spin) {
  boost::asio::use_service<detail::completion_spin>(ctx).set(spin);
}

/// Completes `token` with (std::exception_ptr, R) once the job has ended: (nullptr, value), or
/// (the exception get() would throw, R{}). The handler runs on its associated executor (the
/// caller's, for co_await with use_awaitable; a plain callback without one runs on the troupe
/// thread that ends the job, as job_handle::then(f)); no thread waits meanwhile. A cancellation
/// slot bound to the token (asio::bind_cancellation_slot, or a coroutine's cancellation) cancels
/// the job: the handler then gets troupe::cancelled.
template <class R, class Token>
auto async_get(job_handle<R> h, Token&& token) {
  static_assert(std::is_default_constructible<R>::value,
                "troupe::async_get completes with (std::exception_ptr, R): R must be "
                "default-constructible (the value passed along with an error)");
  namespace net = boost::asio;
  return net::async_initiate<Token, void(std::exception_ptr, R)>(
      [](auto handler, job_handle<R> job) {
        auto slot = net::get_associated_cancellation_slot(handler);
        if (slot.is_connected()) {
          slot.assign([cancel = job.canceller()](net::cancellation_type) { cancel(); });
        }
        // Keeps the handler's executor (an io_context, say) from running out of work while the
        // job runs, then hands it the completion there.
        auto handler_ex = net::get_associated_executor(handler);
        auto* spin = detail::spin_of(handler_ex);
        auto work = net::make_work_guard(handler_ex);
        job.then(
            [handler = std::move(handler), work = std::move(work), spin](outcome<R> o) mutable {
              auto ex = work.get_executor();
              auto complete = [handler = std::move(handler), o = std::move(o)]() mutable {
                // The operation is complete: its cancellation handler goes (Asio's convention).
                auto done_slot = net::get_associated_cancellation_slot(handler);
                if (done_slot.is_connected()) done_slot.clear();
                if (o.ok())
                  std::move(handler)(std::exception_ptr{}, std::move(*o.value));
                else
                  std::move(handler)(o.error, R{});
              };
              // Never inside async_get itself (the job may have ended already): posted to the
              // handler's executor; a handler without one (the system executor, whose post would
              // start a thread pool) runs here, on troupe's thread.
              if constexpr (std::is_same<std::decay_t<decltype(ex)>, net::system_executor>::value)
                net::dispatch(ex, std::move(complete));
              else
                net::post(ex, std::move(complete));
              if (spin) spin->ended();
              work.reset();
            });
        // After then(): one that throws leaves nothing pending. A job that has ended already
        // was counted off above, the count dipping below zero until here: nothing is watched.
        if (spin) spin->started(handler_ex);
      },
      token, std::move(h));
}

}  // namespace troupe
