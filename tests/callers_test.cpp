// Many callers on one pool (docs/api.md, "One pool, many jobs"): failing streams never hang
// their reader, finished jobs hold no thread, the scheduler's cost does not grow with the live
// jobs, deadlines and cancel() do not wait for a busy consumer, a cancel that meets
// consumer::end() loses to it, "forever" durations, wait_for() refused where it would wait for
// itself, stream cancel() from another thread, and speculative copies only of late chunks.
// Each case that could hang runs under a watchdog (test_util::watchdog) and in its own process
// (CTest runs every test on its own).
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

/// Two threads that keep a core busy while a test runs: the core of the thread that creates
/// them (they inherit its pinning), or both cores when it is not pinned. The threads beside
/// them then lose the CPU at any moment.
class busy_threads {
 public:
  busy_threads() {
    for (int t = 0; t < 2; ++t)
      threads_.emplace_back([this] {
        std::uint64_t x = 1;
        while (!stop_.load(std::memory_order_relaxed)) x = x * 6364136223846793005ULL + 1;
        sink_ = x;
      });
  }
  ~busy_threads() {
    stop_ = true;
    for (auto& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> sink_{0};
  std::vector<std::thread> threads_;
};

struct throws_at {
  static inline std::atomic<std::int64_t> bad{-1};
  struct producer {
    std::int64_t work(std::int64_t x) {
      if (x == bad) throw std::runtime_error("bad item");
      return x;
    }
  };
  using consumer = test_jobs::squares::consumer;
};

/// Runs `f` on a thread of its own pinned to the `n`-th CPU this process may use (not pinned
/// where it may use fewer than two) and waits for it; rethrows what `f` throws. The threads that
/// `f` starts inherit the pinning: troupe's, when `f` creates a runner or submits a job.
template <class F>
void on_cpu(int n, F&& f) {
  std::exception_ptr error;
  std::thread t{[&] {
    try {
      cpu_set_t allowed;
      CPU_ZERO(&allowed);
      if (sched_getaffinity(0, sizeof allowed, &allowed) == 0 && CPU_COUNT(&allowed) >= 2) {
        for (int cpu = 0, seen = 0; cpu < CPU_SETSIZE; ++cpu) {
          if (!CPU_ISSET(cpu, &allowed) || seen++ != n) continue;
          cpu_set_t one;
          CPU_ZERO(&one);
          CPU_SET(cpu, &one);
          pthread_setaffinity_np(pthread_self(), sizeof one, &one);
          break;
        }
      }
      f();
    } catch (...) {
      error = std::current_exception();
    }
  }};
  t.join();
  if (error) std::rethrow_exception(error);
}

// 1. The stream of a failing job: its consumer used to wait on the full buffer while the reader
// waited for the consumer (the previous revision hangs in 8 of 8 runs of this test, within a few
// streams). An application that keeps troupe on one core: it creates the runner and opens its
// streams on a thread pinned to that core (troupe's threads inherit the pinning), beside busy
// work of its own, and reads the streams on a thread pinned to another core, counting. Small
// chunks from four producers: when an item throws, more chunks than the stream's buffer holds
// (4) are still queued at the stream's consumer, which gets the core back once the scheduler has
// ended the job, just when the reader, woken by the failure, finds the buffer empty and ends the
// stream.
class FailingStream : public ::testing::TestWithParam<std::size_t> {};

TEST_P(FailingStream, NeverHangsItsReader) {
  troupe::options opts;
  opts.consumer_backlog = GetParam();
  opts.chunk_size = 4;
  std::optional<troupe::unordered_runner<throws_at>> runner;
  std::optional<busy_threads> busy;
  on_cpu(1, [&] {
    runner.emplace(4, troupe::config{}, opts);
    busy.emplace();
  });
  auto xs = iota(2'000);
  for (int i = 0; i < 200; ++i) {
    watchdog dog{20s, "failing stream " + std::to_string(i) + ", consumer_backlog " +
                          std::to_string(GetParam())};
    const std::int64_t bad = 1'000 + (i * 7919) % 1'000;  // late in the stream
    throws_at::bad = bad;
    std::optional<decltype(runner->stream(xs))> stream;
    on_cpu(1, [&] { stream.emplace(runner->stream(xs)); });
    std::int64_t seen = 0;
    bool saw_bad = false;
    on_cpu(0, [&] {
      try {
        for (auto y : *stream) {
          saw_bad = saw_bad || y == bad;
          ++seen;
        }
        ADD_FAILURE() << "stream " << i << " ended without its work_error";
      } catch (const troupe::work_error& e) {
        EXPECT_EQ(e.index(), static_cast<std::uint64_t>(bad));
      }
    });
    EXPECT_FALSE(saw_bad);
    EXPECT_LT(seen, 2'000);
  }
}

INSTANTIATE_TEST_SUITE_P(Callers, FailingStream, ::testing::Values(4, 8));

// 2. Jobs cost no thread: 2,000 finished jobs whose handles are kept.
TEST(Callers, FinishedJobsWithLiveHandlesHoldNoThreads) {
  troupe::unordered_runner<test_jobs::squares> runner{2};
  runner.run(iota(10));
  auto before = test_util::thread_count();
  std::vector<troupe::job_handle<std::int64_t>> kept;
  for (int i = 0; i < 2000; ++i) kept.push_back(runner.submit(iota(3)));
  for (auto& h : kept) EXPECT_EQ(h.get(), 5);
  auto after = test_util::thread_count();
  EXPECT_LE(after, before + 16) << before << " threads before, " << after << " after";
  // And while they run: 2,000 live jobs at once.
  std::vector<troupe::job_handle<std::int64_t>> live;
  for (int i = 0; i < 2000; ++i) live.push_back(runner.submit(iota(3)));
  EXPECT_LE(test_util::thread_count(), before + 16);
  for (auto& h : live) EXPECT_EQ(h.get(), 5);
}

// 3. The scheduler's cost per event does not grow with the live jobs: 16,000 3-item jobs at
// once drain for about the CPU of the same jobs 64 at a time (they took 20-40 times as long).
// The process's CPU time, not the wall clock, and the least of two rounds each, interleaved: a
// machine busy with other work delays both alike.
TEST(Callers, SixteenThousandLiveJobsDrainLikeSixtyFourAtATime) {
  troupe::unordered_runner<test_jobs::squares> runner{2};
  std::vector<std::int64_t> three{1, 2, 3};
  auto cpu_now = [] {
    timespec t{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return std::chrono::seconds{t.tv_sec} + std::chrono::nanoseconds{t.tv_nsec};
  };
  auto drain = [&](std::size_t window) {
    std::vector<troupe::job_handle<std::int64_t>> hs;
    hs.reserve(16'000);
    std::size_t next = 0;
    auto t0 = cpu_now();
    for (int i = 0; i < 16'000; ++i) {
      hs.push_back(runner.submit(three));
      if (window && hs.size() - next >= window) {
        EXPECT_EQ(hs[next++].get(), 14);
      }
    }
    for (; next < hs.size(); ++next) EXPECT_EQ(hs[next].get(), 14);
    return cpu_now() - t0;
  };
  drain(64);  // warm
  auto windowed = drain(64);
  auto at_once = drain(0);
  windowed = std::min(windowed, drain(64));
  at_once = std::min(at_once, drain(0));
  EXPECT_LE(at_once, 4 * windowed)
      << "all at once: " << std::chrono::duration<double, std::milli>(at_once).count()
      << " ms of CPU; 64 at a time: " << std::chrono::duration<double, std::milli>(windowed).count()
      << " ms";
}

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

namespace {

// 11. A contiguous range of numbers is lent to the producers without a copy; once run() returns
// or throws (or the handle is gone) nobody reads it any more. Poisoned right after, a producer
// that still read it would see the poison (and ASan a use after free).
struct reads_lent_range {
  static inline std::atomic<bool> saw_poison{false};
  struct producer {
    std::int64_t work(std::int64_t x) {
      if (x == -1) saw_poison = true;
      if (x == 300'000) throw std::runtime_error("bad item");
      return x;
    }
  };
  using consumer = test_jobs::squares::consumer;
};

TEST(Callers, ALentRangeIsNotReadAfterRunReturns) {
  watchdog dog{60s, "a lent range"};
  reads_lent_range::saw_poison = false;
  troupe::unordered_runner<reads_lent_range> runner{2};
  for (int i = 0; i < 30; ++i) {
    auto xs = std::make_unique<std::vector<std::int64_t>>(iota(1'000'000));
    EXPECT_THROW(runner.run(*xs), troupe::work_error);
    std::fill(xs->begin(), xs->end(), -1);
    xs.reset();
    auto h = runner.submit(iota(100));  // an rvalue: moved into the job, not lent
    auto ys = iota(1'000'000);
    {
      auto lent = runner.submit(troupe::lend(ys));
      std::this_thread::sleep_for(1ms);
    }  // destroyed mid-run: cancelled, and the range taken back
    std::fill(ys.begin(), ys.end(), -1);
    EXPECT_EQ(h.get(), 4950);
  }
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(reads_lent_range::saw_poison) << "a producer read the range after it was back";
}

}  // namespace

namespace {

// 12. A lent range is read a block at a time (a few KiB) under its lease: items that throw on
// either side of a block's edge, and in later blocks of a chunk, keep their indices, and the
// outputs around them come back in order, whole.
struct throws_near_block_edges {
  static bool bad(std::int64_t x) { return x % 2048 == 0 || x % 2048 == 2047 || x % 7777 == 5; }
  struct producer {
    std::int64_t work(std::int64_t x) {
      if (bad(x)) throw std::runtime_error("bad " + std::to_string(x));
      return 3 * x;
    }
  };
  struct consumer {
    void work(std::int64_t y) { ys.push_back(y); }
    std::vector<std::int64_t> end() { return std::move(ys); }
    std::vector<std::int64_t> ys;
  };
};

TEST(Callers, ALentRangeIsReadInBlocksAndFailedItemsKeepTheirIndices) {
  watchdog dog{60s, "a lent range read in blocks"};
  troupe::options opts;
  opts.chunk_size = 10'000;  // chunks span several blocks, and blocks span chunk edges
  troupe::ordered_runner<throws_near_block_edges> runner{2, {}, opts};
  auto xs = iota(100'000);
  troupe::job_options o;
  o.on_error = troupe::error_policy::skip();
  auto h = runner.submit(troupe::lend(xs), o);  // lent: read in place
  auto ys = h.get();
  std::vector<std::int64_t> want;
  std::vector<std::uint64_t> failed;
  for (auto x : xs) {
    if (throws_near_block_edges::bad(x))
      failed.push_back(static_cast<std::uint64_t>(x));
    else
      want.push_back(3 * x);
  }
  EXPECT_EQ(ys, want);
  auto report = h.report();
  ASSERT_EQ(report.failures.size(), failed.size());
  for (std::size_t i = 0; i < failed.size(); ++i) {
    EXPECT_EQ(report.failures[i].index, failed[i]);
    EXPECT_EQ(report.failures[i].what, "bad " + std::to_string(failed[i]));
  }
  // Without a policy a failure ends the job with its index.
  try {
    runner.run(xs);
    ADD_FAILURE() << "no work_error";
  } catch (const troupe::work_error& e) {
    EXPECT_TRUE(throws_near_block_edges::bad(static_cast<std::int64_t>(e.index()))) << e.index();
    EXPECT_NE(std::string{e.what()}.find(": bad " + std::to_string(e.index())), std::string::npos);
  }
}

}  // namespace

namespace {

// 13. A handle destroyed while its job has not ended yet still takes the range back before
// the destructor returns: on troupe's own threads (where cancel() only sends the cancel), and
// while consumer::end() runs (the cancel is refused) with a speculative copy's original still
// working on a chunk. Found by an attack under ASan (a heap-use-after-free in the producer's
// block copy); here the range is poisoned instead of freed, and a producer that read it after
// the destructor would see the poison.
constexpr std::int64_t poison = -7;

struct poison_reader {
  static inline std::atomic<int> saw_poison{0};
  struct producer {
    std::int64_t work(std::int64_t x) {
      if (x == poison) ++saw_poison;
      return x;
    }
  };
  using consumer = test_jobs::squares::consumer;
};

struct submits_from_a_producer {
  static inline troupe::unordered_runner<poison_reader>* inner = nullptr;
  struct producer {
    int work(int k) {
      std::vector<std::int64_t> xs(1'000'000);
      std::iota(xs.begin(), xs.end(), 0);
      {
        auto h = inner->submit(troupe::lend(xs));
        std::this_thread::sleep_for(std::chrono::milliseconds{1 + k % 3});
        if (k % 2) h.cancel();
      }  // destroyed on a producer's thread, the job still running
      std::fill(xs.begin(), xs.end(), poison);
      std::this_thread::sleep_for(5ms);  // a producer that still read it would see the poison
      return k;
    }
  };
};

TEST(Callers, AHandleDestroyedOnTroupesOwnThreadTakesItsRangeBack) {
  watchdog dog{120s, "a handle destroyed on a producer's thread"};
  poison_reader::saw_poison = 0;
  troupe::unordered_runner<poison_reader> inner{2};
  submits_from_a_producer::inner = &inner;
  troupe::unordered_runner<submits_from_a_producer> outer{1};
  std::vector<int> ks(12);
  std::iota(ks.begin(), ks.end(), 0);
  outer.run(ks);
  EXPECT_EQ(poison_reader::saw_poison, 0) << "a producer read a range after its handle was gone";
}

struct slow_original {
  static inline latch* hold = nullptr;    // the original of one chunk waits here
  static inline latch* ending = nullptr;  // consumer::end() has begun
  static inline latch* finish = nullptr;  // consumer::end() waits here
  static inline std::atomic<bool> held{false};
  struct producer {
    std::int64_t work(std::int64_t x) {
      if (x == poison) ++poison_reader::saw_poison;
      if (x == 3 * 4096 + 10 && !held.exchange(true)) hold->wait();
      return x;
    }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() {
      ending->open();
      finish->wait();
      return sum;
    }
    std::int64_t sum = 0;
  };
};

TEST(Callers, AHandleDestroyedWhileEndRunsTakesItsRangeBackFromASlowOriginal) {
  watchdog dog{60s, "a handle destroyed while consumer::end() runs"};
  poison_reader::saw_poison = 0;
  latch hold, ending, finish;
  slow_original::hold = &hold;
  slow_original::ending = &ending;
  slow_original::finish = &finish;
  slow_original::held = false;
  troupe::options opts;
  opts.chunk_size = 4096;  // chunks of 4096 (whatever the pace): the held item is in the first
                           // of its chunk's two blocks
  opts.split_late_chunks = false;  // the whole chunk copied while its original still reads it
  troupe::unordered_runner<slow_original> runner{2, {}, opts};
  auto xs = iota(8 * 4096);
  {
    auto h = runner.submit(troupe::lend(xs));
    ending.wait();  // every output delivered (a speculative copy took the held chunk)
  }                 // cancel() is refused while end() runs: the job has not ended
  std::fill(xs.begin(), xs.end(), poison);
  hold.open();  // the original goes on with its chunk's next block
  std::this_thread::sleep_for(50ms);
  finish.open();
  EXPECT_EQ(poison_reader::saw_poison, 0) << "the slow original read the range after the handle";
  EXPECT_GE(runner.stats().duplicated_items, 4096u);
}

}  // namespace

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
