// troupe::async_get (<troupe/asio.hpp>, docs/api.md "Embedding in applications"): a job's result
// through Boost.Asio completion tokens: co_await with use_awaitable resumes on the caller's
// executor, use_future, plain callbacks with errors, and a cancellation slot that cancels the
// job. C++20 (coroutines), Boost.Asio from Debian's libboost1.81-dev.
#include <gtest/gtest.h>

#include <atomic>
#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>
#include <future>
#include <thread>
#include <troupe/asio.hpp>
#include <troupe/troupe.hpp>

#include "test_jobs.hpp"
#include "test_util.hpp"

namespace net = boost::asio;
using test_util::iota;
using test_util::sum_of_squares;
using test_util::watchdog;
using namespace std::chrono_literals;

namespace {

struct squares_or_fail {
  static inline std::shared_future<void> gate;        // producers wait here when set
  static inline std::atomic<std::uint64_t> calls{0};  // work() calls, every producer
  struct producer {
    std::int64_t work(std::int64_t x) {
      ++calls;
      if (gate.valid()) gate.wait();
      if (x < 0) throw std::runtime_error("negative");
      return x * x;
    }
  };
  using consumer = test_jobs::squares::consumer;
};

TEST(Asio, CoAwaitResumesOnTheCallersExecutor) {
  squares_or_fail::gate = {};
  troupe::unordered_runner<squares_or_fail> runner{2};
  net::io_context io;
  std::int64_t got = 0;
  std::thread::id resumed_on;
  std::exception_ptr failed;
  net::co_spawn(
      io,
      [&]() -> net::awaitable<void> {
        // (The handles are made outside the co_await expressions: GCC 12 miscompiles some
        // temporaries there, "array used as initializer".)
        auto good = runner.submit(iota(1000));
        got = co_await troupe::async_get(std::move(good), net::use_awaitable);
        resumed_on = std::this_thread::get_id();
        std::vector<std::int64_t> bad_items(2, -2);
        auto bad = runner.submit(std::move(bad_items));
        try {
          co_await troupe::async_get(std::move(bad), net::use_awaitable);
        } catch (...) {
          failed = std::current_exception();
        }
      },
      net::detached);
  io.run();  // returns once the coroutine has finished: the jobs kept it busy meanwhile
  EXPECT_EQ(got, sum_of_squares(1000));
  EXPECT_EQ(resumed_on, std::this_thread::get_id()) << "resumed off the io_context's thread";
  ASSERT_TRUE(failed);
  EXPECT_THROW(std::rethrow_exception(failed), troupe::work_error);
}

// 10,000 coroutines on a one-thread io_context, each awaiting its own job: every one resumes on
// that thread with its own exact result, and no thread waits for a job meanwhile.
TEST(Asio, TenThousandCoroutinesOnOneThreadEachGetTheirOwnResult) {
  std::promise<void> open;
  squares_or_fail::gate = open.get_future().share();
  squares_or_fail::calls = 0;
  troupe::unordered_runner<squares_or_fail> runner{2};
  net::io_context io;
  constexpr int n = 10'000;
  int resumed = 0, wrong = 0, off_thread = 0;
  auto loop_thread = std::this_thread::get_id();
  for (int i = 0; i < n; ++i)
    net::co_spawn(
        io,
        [&, i]() -> net::awaitable<void> {
          auto h = runner.submit(std::vector<std::int64_t>{i});
          auto v = co_await troupe::async_get(std::move(h), net::use_awaitable);
          ++resumed;
          if (v != std::int64_t{i} * i) ++wrong;
          if (std::this_thread::get_id() != loop_thread) ++off_thread;
        },
        net::detached);
  io.poll();  // every coroutine has submitted its job and waits: the producers are held
  auto threads = test_util::thread_count();
  EXPECT_EQ(resumed, 0);
  open.set_value();
  io.run();
  squares_or_fail::gate = {};
  EXPECT_EQ(resumed, n);
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(off_thread, 0);
  EXPECT_EQ(test_util::thread_count(), threads) << "a thread per pending job?";
  // One work() call per item, and one more per speculative copy: none lost, none repeated.
  runner.close();
  EXPECT_EQ(squares_or_fail::calls.load(), n + runner.stats().duplicated_items);
}

// async_get keeps the loop's thread awake a short while after it (a "watcher" handler that
// re-posts itself, as get() spins before it sleeps); set_completion_spin(io, 0) turns that off.
// Counted in handlers run: the same coroutine runs the same handlers each time without the spin,
// and at least one more (the watcher's turns) with it.
TEST(Asio, TheCompletionSpinRunsOnTheLoopAndCanBeTurnedOff) {
  squares_or_fail::gate = {};
  troupe::unordered_runner<squares_or_fail> runner{2};
  auto handlers_run = [&](bool spin) {
    net::io_context io;
    if (!spin) troupe::set_completion_spin(io, std::chrono::microseconds{0});
    std::int64_t sum = 0;
    net::co_spawn(
        io,
        [&]() -> net::awaitable<void> {
          for (int i = 1; i <= 20; ++i) {
            auto h = runner.submit(iota(i));
            sum += co_await troupe::async_get(std::move(h), net::use_awaitable);
          }
        },
        net::detached);
    auto handlers = io.run();  // returns: the watcher stops once nothing is pending
    std::int64_t want = 0;
    for (int i = 1; i <= 20; ++i) want += sum_of_squares(i);
    EXPECT_EQ(sum, want);
    return handlers;
  };
  auto quiet = handlers_run(false);
  EXPECT_EQ(handlers_run(false), quiet);
  EXPECT_GT(handlers_run(true), quiet);
}

// close() while 100 coroutines await their jobs (held in the producers): each resumes once, on
// the loop's thread, with runner_closed; the loop then runs out of work and returns.
TEST(Asio, CloseWhileCoroutinesAwaitResumesEachWithRunnerClosed) {
  std::promise<void> open;
  squares_or_fail::gate = open.get_future().share();
  troupe::unordered_runner<squares_or_fail> runner{2};
  net::io_context io;
  int closed = 0, other = 0, off_thread = 0;
  auto loop_thread = std::this_thread::get_id();
  for (int i = 0; i < 100; ++i)
    net::co_spawn(
        io,
        [&, i]() -> net::awaitable<void> {
          auto h = runner.submit(std::vector<std::int64_t>{i});
          try {
            co_await troupe::async_get(std::move(h), net::use_awaitable);
            ++other;
          } catch (const troupe::runner_closed&) {
            ++closed;
          } catch (...) {
            ++other;
          }
          if (std::this_thread::get_id() != loop_thread) ++off_thread;
        },
        net::detached);
  io.poll();  // all 100 wait
  // close() ends every job at once, the two whose items the producers hold included; it waits
  // for those calls to return (on another thread: the gate opens only after every coroutine
  // has resumed).
  watchdog dog{60s, "close() while coroutines await"};
  std::thread closer{[&] { runner.close(); }};
  while (closed + other < 100) io.run_one();
  open.set_value();
  closer.join();
  io.run();
  squares_or_fail::gate = {};
  EXPECT_EQ(closed, 100);
  EXPECT_EQ(other, 0);
  EXPECT_EQ(off_thread, 0);
}

TEST(Asio, UseFutureAndPlainCallbacks) {
  squares_or_fail::gate = {};
  troupe::unordered_runner<squares_or_fail> runner{2};
  auto f = troupe::async_get(runner.submit(iota(100)), net::use_future);
  EXPECT_EQ(f.get(), sum_of_squares(100));
  auto bad = troupe::async_get(runner.submit(std::vector<std::int64_t>{-1}), net::use_future);
  EXPECT_THROW(bad.get(), troupe::work_error);
  net::io_context io;
  std::int64_t value = -1;
  bool called = false;
  troupe::async_get(runner.submit(iota(10)),
                    net::bind_executor(io, [&](std::exception_ptr e, std::int64_t v) {
                      called = true;
                      EXPECT_FALSE(e);
                      value = v;
                    }));
  io.run();
  EXPECT_TRUE(called);
  EXPECT_EQ(value, sum_of_squares(10));
}

TEST(Asio, ACancellationSlotCancelsTheJob) {
  std::promise<void> open;
  squares_or_fail::gate = open.get_future().share();
  troupe::unordered_runner<squares_or_fail> runner{1};
  net::io_context io;
  net::cancellation_signal signal;
  std::exception_ptr error;
  bool called = false;
  troupe::async_get(
      runner.submit(iota(100)),
      net::bind_cancellation_slot(signal.slot(),
                                  net::bind_executor(io, [&](std::exception_ptr e, std::int64_t) {
                                    called = true;
                                    error = e;
                                  })));
  signal.emit(net::cancellation_type::terminal);  // the producer is still held: the job runs
  io.run();
  EXPECT_TRUE(called);
  ASSERT_TRUE(error);
  EXPECT_THROW(std::rethrow_exception(error), troupe::cancelled);
  open.set_value();
  squares_or_fail::gate = {};
}

}  // namespace
