// troupe::async_get: a job's result through any Boost.Asio completion token (docs/api.md,
// "Embedding in applications"). Header-only and optional: Boost.Asio from Debian's
// libboost1.81-dev; C++20 for co_await with asio::use_awaitable (use_future, deferred and plain
// callbacks work in C++17). troupe's own package does not depend on Boost.
#pragma once

#include <boost/asio/associated_cancellation_slot.hpp>
#include <boost/asio/associated_executor.hpp>
#include <boost/asio/async_result.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/system_executor.hpp>
#include <exception>
#include <memory>
#include <type_traits>
#include <utility>

#include "troupe/job_handle.hpp"

namespace troupe {

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
        auto work = net::make_work_guard(net::get_associated_executor(handler));
        job.then([handler = std::move(handler), work = std::move(work)](outcome<R> o) mutable {
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
          work.reset();
        });
      },
      token, std::move(h));
}

}  // namespace troupe
