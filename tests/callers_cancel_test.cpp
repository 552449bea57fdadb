// Many callers on one pool, continued: deadlines and cancel() do not wait for a busy consumer,
// a cancel that meets consumer::end() loses to it, "forever" durations, wait_for() refused
// where it would wait for itself, stream cancel() from another thread, and speculative copies
// only of late chunks.
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

namespace {

using test_util::latch;

/// Counts the live objects of a class that derives from it.
template <class Tag>
struct counted_life {
  static inline std::atomic<int> alive{0};
  counted_life() { ++alive; }
  counted_life(const counted_life&) = delete;
  ~counted_life() { --alive; }
};

// 4. A deadline or cancel() ends get() whatever the consumer is doing.
struct blocking_consumer {
  static inline latch* entered = nullptr;
  static inline latch* release = nullptr;
  static inline std::atomic<int> calls{0};
  struct producer {
    std::int64_t work(std::int64_t x) { return x; }
  };
  struct consumer : counted_life<blocking_consumer> {
    void work(std::int64_t) {
      ++calls;
      entered->open();
      release->wait();
    }
    int end() { return 1; }
  };
};

/// Waits until no object counted by `alive` is left (bounded: 10 s).
void wait_gone(const std::atomic<int>& alive) {
  for (int i = 0; i < 2000 && alive != 0; ++i) std::this_thread::sleep_for(5ms);
  ASSERT_EQ(alive, 0) << "a consumer was never destroyed";
}
void wait_consumers_gone() {
  wait_gone(counted_life<blocking_consumer>::alive);
}

class ConsumerBlocked : public ::testing::Test {
 protected:
  ConsumerBlocked() {
    blocking_consumer::entered = &entered;
    blocking_consumer::release = &release;
    blocking_consumer::calls = 0;
  }
  ~ConsumerBlocked() override {
    release.open();
    wait_consumers_gone();
  }
  latch entered, release;
  watchdog dog{60s, "a job whose consumer is blocked"};
};

TEST_F(ConsumerBlocked, ADeadlineThrowsWhileTheConsumerIsStillInWork) {
  troupe::unordered_runner<blocking_consumer> runner{2};
  troupe::job_options o;
  o.deadline = 100ms;
  EXPECT_THROW(runner.run(iota(100'000), o), troupe::deadline_exceeded);
  EXPECT_FALSE(release.is_open());  // get() returned while consumer::work was blocked
  EXPECT_EQ(blocking_consumer::calls, 1);
  release.open();
  wait_consumers_gone();
  EXPECT_EQ(blocking_consumer::calls, 1) << "consumer::work ran after the job had ended";
}

TEST_F(ConsumerBlocked, GetAfterCancelReturnsWhileTheConsumerIsStillInWork) {
  troupe::unordered_runner<blocking_consumer> runner{2};
  auto h = runner.submit(iota(100'000));
  entered.wait();
  h.cancel();
  EXPECT_THROW(h.get(), troupe::cancelled);
  EXPECT_FALSE(release.is_open());
  release.open();
  wait_consumers_gone();
  EXPECT_EQ(blocking_consumer::calls, 1);
}

TEST_F(ConsumerBlocked, DestroyingARunningJobsHandleDoesNotWaitForTheConsumer) {
  troupe::unordered_runner<blocking_consumer> runner{2};
  {
    auto h = runner.submit(iota(100'000));
    entered.wait();
  }  // cancels
  EXPECT_FALSE(release.is_open());
  release.open();
  wait_consumers_gone();
  EXPECT_EQ(blocking_consumer::calls, 1);
}

// 5. After cancel() the consumer stops at its next item, and report().delivered is exact.
struct counted_consumer {
  static inline std::atomic<std::uint64_t> calls{0};
  struct producer {
    std::int64_t work(std::int64_t x) { return x; }
  };
  struct consumer : counted_life<counted_consumer> {
    void work(std::int64_t) {
      ++calls;
      std::this_thread::sleep_for(20us);
    }
    int end() { return 0; }
  };
};

TEST(Callers, AfterCancelTheConsumerStopsAndDeliveredCountsWhatItTook) {
  watchdog dog{60s, "cancel with a slow consumer"};
  counted_consumer::calls = 0;
  troupe::unordered_runner<counted_consumer> runner{2};
  auto h = runner.submit(iota(1'000'000));
  while (counted_consumer::calls < 1000) std::this_thread::sleep_for(1ms);
  h.cancel();
  EXPECT_THROW(h.get(), troupe::cancelled);
  wait_gone(counted_life<counted_consumer>::alive);
  auto calls = counted_consumer::calls.load();
  EXPECT_EQ(h.report().delivered, calls);
  EXPECT_LT(calls, 1'000'000u);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(counted_consumer::calls, calls) << "consumer::work ran after its consumer was gone";
}

// 6. A cancel or deadline that lands while consumer::end() runs loses: end()'s value is the
// result (it used to finish and be thrown away).
struct blocking_end {
  static inline latch* entered = nullptr;
  static inline latch* release = nullptr;
  struct producer {
    std::int64_t work(std::int64_t x) { return x; }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() {
      entered->open();
      release->wait();
      return sum;
    }
    std::int64_t sum = 0;
  };
};

TEST(Callers, ACancelThatMeetsEndLosesToIt) {
  watchdog dog{60s, "cancel during consumer::end()"};
  latch entered, release;
  blocking_end::entered = &entered;
  blocking_end::release = &release;
  troupe::unordered_runner<blocking_end> runner{2};
  auto h = runner.submit(iota(100));
  entered.wait();
  h.cancel();  // returns: the scheduler has seen it (and let end() win)
  release.open();
  EXPECT_EQ(h.get(), 4950);
}

TEST(Callers, ADeadlineThatPassesDuringEndLosesToIt) {
  watchdog dog{60s, "deadline during consumer::end()"};
  latch entered, release;
  blocking_end::entered = &entered;
  blocking_end::release = &release;
  troupe::unordered_runner<blocking_end> runner{2};
  troupe::job_options o;
  o.deadline = 2s;  // long enough that a loaded machine still reaches end() before it
  auto h = runner.submit(iota(100), o);
  entered.wait();
  EXPECT_FALSE(h.wait_for(3s));  // the deadline passes meanwhile
  release.open();
  EXPECT_EQ(h.get(), 4950);
  EXPECT_EQ(h.report().delivered, 100u);
}

// 7. milliseconds::max() means "forever" everywhere (it used to overflow: a deadline fired at
// once, close() did not wait, wait_for() returned false at once).
struct slow_end {
  static inline std::atomic<int> ended{0};
  struct producer {
    std::int64_t work(std::int64_t x) { return x * x; }
    void end() {
      std::this_thread::sleep_for(300ms);
      ++ended;
    }
  };
  using consumer = test_jobs::squares::consumer;
};

TEST(Callers, MillisecondsMaxIsForever) {
  watchdog dog{60s, "milliseconds::max()"};
  slow_end::ended = 0;
  troupe::options opts;
  opts.close_timeout = std::chrono::milliseconds::max();
  opts.work_timeout = std::chrono::milliseconds::max();
  troupe::unordered_runner<slow_end> runner{2, {}, opts};
  troupe::job_options o;
  o.deadline = std::chrono::milliseconds::max();
  EXPECT_EQ(runner.run(iota(1000), o), test_util::sum_of_squares(1000));
  auto h = runner.submit(iota(1000), o);
  EXPECT_TRUE(h.wait_for(std::chrono::milliseconds::max()));
  EXPECT_EQ(h.get(), test_util::sum_of_squares(1000));
  runner.close();  // waits for both producers' end(), 300 ms each
  EXPECT_EQ(slow_end::ended, 2);
}

// 8. wait_for() on troupe's own threads is refused (it could never see its job end there, and
// it held up every job).
struct waits_in_consumer {
  static inline troupe::job_handle<std::int64_t>* other = nullptr;
  static inline std::atomic<int> refused{0};
  static inline std::atomic<int> polled{0};
  struct producer {
    std::int64_t work(std::int64_t x) { return x; }
  };
  struct consumer {
    void work(std::int64_t) {
      try {
        (void)other->wait_for(10ms);
      } catch (const troupe::invalid_argument&) {
        ++refused;
      }
      try {
        (void)other->wait_for(0ms);  // a zero wait only looks: allowed
        ++polled;
      } catch (const troupe::invalid_argument&) {
      }
    }
    std::int64_t end() { return 0; }
  };
};

TEST(Callers, WaitForOnTroupesOwnThreadsIsRefused) {
  watchdog dog{60s, "wait_for() in a consumer"};
  troupe::unordered_runner<test_jobs::squares> other_runner{1};
  auto unfinished = other_runner.submit(troupe::generate([]() -> std::optional<std::int64_t> {
    std::this_thread::sleep_for(1ms);
    return 1;  // endless
  }));
  waits_in_consumer::other = &unfinished;
  waits_in_consumer::refused = 0;
  waits_in_consumer::polled = 0;
  troupe::unordered_runner<waits_in_consumer> runner{2};
  EXPECT_EQ(runner.run(iota(5)), 0);
  EXPECT_EQ(waits_in_consumer::refused, 5);
  EXPECT_EQ(waits_in_consumer::polled, 5);
  unfinished.cancel();
}

// 9. output_stream::cancel() from another thread ends the reader's loop without an error (it
// used to throw cancelled into it).
struct slow_items {
  struct producer {
    std::int64_t work(std::int64_t x) {
      std::this_thread::sleep_for(2ms);
      return x;
    }
  };
};

TEST(Callers, StreamCancelFromAnotherThreadEndsTheLoopQuietly) {
  watchdog dog{60s, "stream cancel from another thread"};
  troupe::ordered_runner<slow_items> runner{2};
  auto s = runner.stream(iota(100'000));
  std::atomic<int> read{0};
  std::thread canceller([&] {
    while (read < 5) std::this_thread::sleep_for(1ms);
    s.cancel();
  });
  EXPECT_NO_THROW({
    for (auto y : s) {
      EXPECT_EQ(y, read.load());
      ++read;
    }
  });
  canceller.join();
  EXPECT_GE(read, 5);
  EXPECT_LT(read, 100'000);
}

// 10. Speculative copies only of late chunks: healthy runs compute every item once.
std::atomic<std::uint64_t> square_calls{0};
struct counted_squares {
  struct producer {
    std::int64_t work(std::int64_t x) {
      ++square_calls;
      return x * x;
    }
  };
  using consumer = test_jobs::squares::consumer;
};

TEST(Callers, HealthyJobsAreComputedOnce) {
  square_calls = 0;
  troupe::unordered_runner<counted_squares> runner{4};
  std::uint64_t delivered = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<troupe::job_handle<std::int64_t>> hs;
    for (int j = 0; j < 100; ++j) hs.push_back(runner.submit(iota(8)));
    for (auto& h : hs) {
      EXPECT_EQ(h.get(), 140);
      delivered += h.report().delivered;
    }
  }
  EXPECT_EQ(delivered, 2400u);
  EXPECT_LE(static_cast<double>(square_calls), 1.02 * static_cast<double>(delivered));
  EXPECT_EQ(runner.stats().duplicated_items, square_calls - delivered);
}

struct holds_item_5 {
  static inline latch* release = nullptr;
  static inline std::atomic<bool> held{false};
  struct producer {
    int work(int x) {
      if (x == 5 && !held.exchange(true)) release->wait();
      return x;
    }
  };
};

TEST(Callers, ALateChunkIsCopiedAndTheCopyCounted) {
  watchdog dog{60s, "a late chunk"};
  latch release;
  holds_item_5::release = &release;
  holds_item_5::held = false;
  troupe::options opts;
  opts.chunk_size = 1;
  troupe::ordered_runner<holds_item_5> runner{2, {}, opts};
  std::vector<int> xs(50);
  std::iota(xs.begin(), xs.end(), 0);
  EXPECT_EQ(runner.run(xs), xs);  // only a copy of item 5 lets it end
  EXPECT_GE(runner.stats().duplicated_items, 1u);
  release.open();
}

}  // namespace
