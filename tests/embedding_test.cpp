// Embedding in applications (docs/api.md, "Embedding in applications"): completions without
// a blocked thread, inputs that cannot dangle, and a CAF application awaiting a runner.
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>

#include "test_jobs.hpp"
#include "test_util.hpp"

using test_util::iota;
using test_util::watchdog;
using namespace std::chrono_literals;
using test_util::latch;

namespace {

// 14. Embedding (docs/api.md, "Embedding in applications"): completions without a blocked
// thread, and inputs that cannot dangle.

/// Producers wait at a gate until the test opens it (so that jobs stay pending).
struct gated_squares {
  static inline latch* gate = nullptr;
  struct producer {
    std::int64_t work(std::int64_t x) {
      gate->wait();
      if (x < 0) throw std::runtime_error("negative");
      return x * x;
    }
  };
  using consumer = test_jobs::squares::consumer;
};

/// An application's executor: tasks queue here and run when the application drains them, on
/// the application's thread.
class manual_executor {
 public:
  void post(std::function<void()> f) {
    std::lock_guard<std::mutex> guard{mtx_};
    tasks_.push_back(std::move(f));
    cv_.notify_all();
  }
  /// Runs the queued tasks on this thread; waits for at least `n` in all.
  std::size_t drain(std::size_t n) {
    std::size_t ran = 0;
    while (ran < n) {
      std::function<void()> f;
      {
        std::unique_lock<std::mutex> lock{mtx_};
        cv_.wait(lock, [this] { return !tasks_.empty(); });
        f = std::move(tasks_.front());
        tasks_.pop_front();
      }
      f();
      ++ran;
    }
    return ran;
  }
  std::size_t queued() {
    std::lock_guard<std::mutex> guard{mtx_};
    return tasks_.size();
  }

 private:
  std::mutex mtx_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
};

TEST(Embedding, ThenHandsTheValueOrTheErrorToTheApplicationsExecutorOnce) {
  watchdog dog{60s, "then() on an executor"};
  latch gate;
  gated_squares::gate = &gate;
  troupe::unordered_runner<gated_squares> runner{2};
  manual_executor app;
  auto post = [&](std::function<void()> f) { app.post(std::move(f)); };
  const auto me = std::this_thread::get_id();
  std::vector<int> calls(3, 0);
  std::optional<std::int64_t> value;
  std::exception_ptr error;
  auto good = runner.submit(iota(100));
  auto bad = runner.submit(std::vector<std::int64_t>{1, -2, 3});
  good.then(post, [&](troupe::outcome<std::int64_t> o) {
    ++calls[0];
    EXPECT_EQ(std::this_thread::get_id(), me) << "f ran off the application's executor";
    value = o.get();
  });
  bad.then(post, [&](troupe::outcome<std::int64_t> o) {
    ++calls[1];
    EXPECT_EQ(std::this_thread::get_id(), me);
    EXPECT_FALSE(o.ok());
    error = o.error;
  });
  EXPECT_FALSE(good.valid()) << "then() empties the handle";
  EXPECT_THROW(good.then([](troupe::outcome<std::int64_t>) {}), troupe::invalid_argument);
  EXPECT_EQ(app.queued(), 0u) << "a callback came before the jobs could end";
  gate.open();
  app.drain(2);
  EXPECT_EQ(calls[0], 1);
  EXPECT_EQ(calls[1], 1);
  EXPECT_EQ(value, test_util::sum_of_squares(100));
  ASSERT_TRUE(error);
  EXPECT_THROW(std::rethrow_exception(error), troupe::work_error);
  // A job that has ended already: handed to the executor at once.
  auto h = runner.submit(iota(10));
  h.wait_for(std::chrono::milliseconds::max());
  h.then(post, [&](troupe::outcome<std::int64_t> o) {
    ++calls[2];
    value = o.get();
  });
  EXPECT_EQ(app.queued(), 1u);
  app.drain(1);
  EXPECT_EQ(calls[2], 1);
  EXPECT_EQ(value, test_util::sum_of_squares(10));
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(app.queued(), 0u) << "a callback ran twice";
}

TEST(Embedding, TenThousandPendingThensHoldNoThreadAndTheirHandlesMayDie) {
  watchdog dog{120s, "10,000 pending then()s"};
  latch gate;
  gated_squares::gate = &gate;
  troupe::unordered_runner<gated_squares> runner{2};
  constexpr int jobs = 10'000;
  std::vector<std::atomic<int>> calls(jobs);
  std::vector<std::int64_t> got(jobs, -1);
  std::atomic<int> done{0};
  auto before = test_util::thread_count();
  for (int i = 0; i < jobs; ++i) {
    auto h = runner.submit(std::vector<std::int64_t>{i});
    h.then([&, i](troupe::outcome<std::int64_t> o) {  // on troupe's thread: short
      ++calls[static_cast<std::size_t>(i)];
      got[static_cast<std::size_t>(i)] = o.get();
      ++done;
    });
  }  // every handle is dropped here: the jobs go on
  auto pending = test_util::thread_count();
  EXPECT_EQ(done, 0) << "the producers are held: no job can have ended";
  EXPECT_LE(pending, before + 16) << before << " threads before, " << pending << " pending";
  gate.open();
  while (done < jobs) std::this_thread::sleep_for(1ms);
  for (int i = 0; i < jobs; ++i) {
    EXPECT_EQ(calls[static_cast<std::size_t>(i)], 1) << "job " << i;
    EXPECT_EQ(got[static_cast<std::size_t>(i)], std::int64_t{i} * i) << "job " << i;
  }
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(done, jobs) << "a callback ran twice";
}

TEST(Embedding, AThenCallbackThatThrowsDoesNotStopTheRunner) {
  watchdog dog{60s, "a throwing then()"};
  troupe::unordered_runner<test_jobs::squares> runner{2};
  std::atomic<int> ran{0};
  for (int i = 0; i < 50; ++i)
    runner.submit(iota(10)).then([&](troupe::outcome<std::int64_t>) {
      ++ran;
      throw std::runtime_error("an application bug");
    });
  EXPECT_EQ(runner.run(iota(100)), test_util::sum_of_squares(100));
  while (ran < 50) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(runner.run(iota(10)), test_util::sum_of_squares(10));
}

TEST(Embedding, AnLvalueRangeIsCopiedSoTheCallersRangeMayChangeOrDieAtOnce) {
  watchdog dog{60s, "inputs that cannot dangle"};
  latch gate;
  gated_squares::gate = &gate;
  troupe::unordered_runner<gated_squares> runner{2};
  // The probe's mistake: a local vector submitted, the handle kept, the vector gone. Here it
  // is overwritten first (a read of it after submit() would see -1 and throw) and then freed.
  auto submit_local = [&] {
    auto xs = std::make_unique<std::vector<std::int64_t>>(iota(100'000));
    auto h = runner.submit(*xs);
    std::fill(xs->begin(), xs->end(), -1);
    return h;
  };
  auto h = submit_local();
  std::vector<std::int64_t> ys = iota(1000);
  auto moved = runner.submit(std::move(ys));
  gate.open();
  EXPECT_EQ(h.get(), test_util::sum_of_squares(100'000));
  EXPECT_EQ(moved.get(), test_util::sum_of_squares(1000));
  // troupe::lend reads in place: what the range holds when the producers read it.
  gated_squares::gate = &gate;
  auto zs = iota(1000);
  auto lent = runner.submit(troupe::lend(zs));
  EXPECT_EQ(lent.get(), test_util::sum_of_squares(1000));
  int arr[] = {1, 2, 3};
  auto from_array = runner.submit(arr);  // a C array is copied too
  arr[0] = -1;
  EXPECT_EQ(from_array.get(), 14);
}

}  // namespace

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scoped_actor.hpp>
#include <troupe/caf.hpp>

namespace {

// troupe inside a CAF application: the application's actor system serves the runner, and a CAF
// actor awaits a job with request(...).then(...) like any other actor.
TEST(Embedding, ACafApplicationAwaitsARunnerOnItsOwnActorSystem) {
  watchdog dog{60s, "troupe inside a CAF application"};
  caf::actor_system_config cfg;
  troupe::add_to(cfg);
  caf::actor_system sys{cfg};
  {
    auto before = test_util::thread_count();
    troupe::unordered_runner<test_jobs::squares> runner{sys, troupe::cpus(2)};
    // Two producers and the scheduler have threads of their own; no second thread pool.
    EXPECT_LE(test_util::thread_count(), before + 3);
    EXPECT_EQ(&runner.system(), &sys);
    auto a = runner.actor();
    std::promise<std::int64_t> got;
    // (An argument, however useless: a spawn without one makes CAF 0.17.6 dereference a null
    // std::shared_ptr<std::tuple<>>, which UBSan reports.)
    sys.spawn(
        [a, &got](caf::event_based_actor* self, int) {
          self->request(a, caf::infinite, troupe::submit_atom::value, iota(100))
              .then([&got](std::int64_t sum) { got.set_value(sum); });
          self->request(a, caf::infinite, troupe::submit_atom::value,
                        std::vector<std::int64_t>{1, 2, 3})
              .then([](std::int64_t) {});
        },
        0);
    EXPECT_EQ(got.get_future().get(), test_util::sum_of_squares(100));
    // Many requests at once from a blocking caller: each is a job; every answer is exact.
    caf::scoped_actor self{sys};
    for (int i = 1; i <= 50; ++i)
      self->request(a, caf::infinite, troupe::submit_atom::value, iota(i))
          .receive([&](std::int64_t sum) { EXPECT_EQ(sum, test_util::sum_of_squares(i)); },
                   [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
    runner.close();
    // After close(): the actor is gone (its requests fail), nothing hangs.
    bool answered = false;
    self->request(a, std::chrono::seconds{10}, troupe::submit_atom::value, iota(3))
        .receive([&](std::int64_t) { answered = true; }, [&](caf::error&) {});
    EXPECT_FALSE(answered);
  }
}

}  // namespace
