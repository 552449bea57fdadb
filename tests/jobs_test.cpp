// One pool, many jobs: submit() from several threads, job handles, cancel, deadlines, streams
// and the fair share (jobs_errors_test.cpp: error policies and quarantine). No timing
// thresholds: counters and the order of events (a test that would hang is caught by CTest's
// timeout).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <thread>

#include "test_jobs.hpp"
#include "test_util.hpp"

using test_util::iota;
using test_util::peak_rss_kib;
using test_util::sum_of_squares;
using namespace std::chrono_literals;
using namespace test_jobs;

namespace {

// -- shared counters of the jobs below (reset by each test) ------------------------------------

std::atomic<std::int64_t> worked{0};     // producer::work calls
std::atomic<std::int64_t> pulled{0};     // items the generators handed out
std::atomic<bool> big_job_ended{false};  // the consumer of the "big" job ran end()
std::atomic<bool> small_saw_big_running{false};
std::atomic<bool> stuck_item_returned{false};

void reset_counters() {
  worked = 0;
  pulled = 0;
  big_job_ended = false;
  small_saw_big_running = false;
  stuck_item_returned = false;
}

/// A generator of 0, 1, ..., n-1 that counts what it hands out.
auto counted(std::int64_t n) {
  return troupe::generate([i = std::int64_t{0}, n]() mutable -> std::optional<std::int64_t> {
    if (i == n) return std::nullopt;
    ++pulled;
    return i++;
  });
}

/// x*x after config "sleep_us" microseconds; the consumer sums. Items >= 1'000'000 belong to
/// the "small" job of the overlap test, the others to the "big" one.
struct napper {
  struct producer {
    producer(const troupe::device&, const troupe::config& cfg)
        : sleep_us(cfg.get_or<std::int64_t>("sleep_us", 0)) {}
    std::int64_t work(std::int64_t x) {
      ++worked;
      if (sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      if (x == -1) {  // stuck: far longer than any deadline in these tests
        std::this_thread::sleep_for(3s);
        stuck_item_returned = true;
      }
      return x * x;
    }
    std::int64_t sleep_us;
  };
  struct consumer {
    void work(std::int64_t y) {
      if (y >= 1'000'000'000'000) {
        small = true;
        if (!big_job_ended) small_saw_big_running = true;
      }
      sum += y;
    }
    std::int64_t end() {
      if (!small) big_job_ended = true;
      return sum;
    }
    std::int64_t sum = 0;
    bool small = false;
  };
};

troupe::config sleep_us(std::int64_t us) {
  troupe::config cfg;
  cfg.set("sleep_us", us);
  return cfg;
}

// -- several jobs at once -----------------------------------------------------------------------

TEST(Jobs, TwoJobsFromTwoThreadsOverlapAndBothAreExact) {
  reset_counters();
  troupe::ordered_runner<napper> runner{2, sleep_us(200)};
  std::promise<void> big_started;
  std::int64_t big = 0, small = 0;
  std::thread a{[&] {
    auto h = runner.submit(iota(2000));
    big_started.set_value();
    big = h.get();
  }};
  big_started.get_future().wait();
  std::thread b{[&] {
    std::vector<std::int64_t> in;
    for (std::int64_t i = 0; i < 20; ++i) in.push_back(1'000'000 + i);
    small = runner.run(in);
  }};
  a.join();
  b.join();
  EXPECT_EQ(big, sum_of_squares(2000));
  std::int64_t want = 0;
  for (std::int64_t i = 0; i < 20; ++i) want += (1'000'000 + i) * (1'000'000 + i);
  EXPECT_EQ(small, want);
  // The small job got outputs while the big one was still running: they shared the producers.
  EXPECT_TRUE(small_saw_big_running.load());
  EXPECT_EQ(runner.stats().runs, 2u);
}

TEST(Jobs, ManyThreadsSubmitAtOnceAndEveryJobIsExact) {
  troupe::unordered_runner<squares> runner{3};
  std::vector<std::thread> threads;
  std::atomic<int> exact{0};
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      for (int k = 0; k < 5; ++k) {
        auto n = 1000 * (t + 1) + k;
        if (runner.submit(iota(n)).get() == sum_of_squares(n)) ++exact;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(exact.load(), 40);
  EXPECT_EQ(runner.stats().runs, 40u);
  EXPECT_EQ(runner.stats().failed_runs, 0u);
}

TEST(Jobs, HandleMembersAndGetOnce) {
  troupe::unordered_runner<squares> runner{2};
  auto h = runner.submit({1, 2, 3});
  EXPECT_TRUE(h.valid());
  while (!h.wait_for(10ms)) {
  }
  EXPECT_TRUE(h.done());
  EXPECT_EQ(h.get(), 14);
  EXPECT_THROW(h.get(), troupe::invalid_argument);
  auto r = h.report();
  EXPECT_EQ(r.items, 3u);
  EXPECT_EQ(r.delivered, 3u);
  EXPECT_TRUE(r.failures.empty());
  EXPECT_EQ(h.progress().done, 3u);
  troupe::job_handle<std::int64_t> empty;
  EXPECT_THROW(empty.get(), troupe::invalid_argument);
  troupe::job_options bad;
  bad.weight = 0;
  EXPECT_THROW(runner.submit({1}, bad), troupe::invalid_argument);
}

// -- cancel, deadline, close --------------------------------------------------------------------

TEST(Jobs, CancelStopsTheJobAndTheNextJobWorks) {
  reset_counters();
  troupe::unordered_runner<napper> runner{2, sleep_us(1000)};
  auto h = runner.submit(counted(1'000'000));
  while (h.progress().done == 0 && !h.wait_for(5ms)) {
  }
  h.cancel();
  // From here on no item of the job is handed to a producer: nothing more is pulled, and the
  // producers work at most on what had been pulled (sent) before.
  auto at_cancel = pulled.load();
  EXPECT_THROW(h.get(), troupe::cancelled);
  std::this_thread::sleep_for(100ms);  // room for a wrongly dispatched chunk to show
  EXPECT_EQ(pulled.load(), at_cancel);
  EXPECT_LE(worked.load(), at_cancel);
  EXPECT_LT(at_cancel, 1'000'000);
  EXPECT_EQ(runner.run(iota(100)), sum_of_squares(100));
  h.cancel();  // idempotent after the end
}

TEST(Jobs, DestroyingAnUnfinishedHandleCancelsItsJob) {
  reset_counters();
  troupe::unordered_runner<napper> runner{2, sleep_us(1000)};
  {
    auto h = runner.submit(counted(1'000'000));
    while (h.progress().done == 0 && !h.wait_for(5ms)) {
    }
  }
  auto after = pulled.load();
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(pulled.load(), after);
  EXPECT_LT(after, 1'000'000);
  EXPECT_EQ(runner.run(iota(100)), sum_of_squares(100));
}

TEST(Jobs, DeadlineEndsTheJobPromptlyEvenWithAStuckProducer) {
  reset_counters();
  troupe::unordered_runner<napper> runner{2};
  troupe::job_options o;
  o.deadline = 200ms;
  std::vector<std::int64_t> in{-1};  // stuck for 3 s on one producer
  for (std::int64_t i = 0; i < 100'000; ++i) in.push_back(i);
  auto h = runner.submit(in, o);
  EXPECT_THROW(h.get(), troupe::deadline_exceeded);
  // Thrown before the stuck item returned: it did not wait for the items in flight.
  EXPECT_FALSE(stuck_item_returned.load());
  EXPECT_TRUE(h.done());
  auto w = worked.load();
  std::this_thread::sleep_for(100ms);
  // Nothing of the job is handed out any more: the stuck producer's one item aside, at most
  // the other's step under way when `w` was read (up to 32 items between two looks at the cut).
  EXPECT_LE(worked.load(), w + 33);
  EXPECT_EQ(runner.run(iota(100)), sum_of_squares(100));  // on the producer that is free
  EXPECT_EQ(runner.stats().failed_runs, 1u);
}

TEST(Jobs, CloseEndsRunningJobsWithRunnerClosed) {
  troupe::unordered_runner<napper> runner{2, sleep_us(1000)};
  std::vector<troupe::job_handle<std::int64_t>> jobs;
  for (int k = 0; k < 4; ++k) jobs.push_back(runner.submit(counted(1'000'000)));
  runner.close();
  for (auto& h : jobs) EXPECT_THROW(h.get(), troupe::runner_closed);
  EXPECT_THROW(runner.submit({1}), troupe::runner_closed);
}

// -- streams ------------------------------------------------------------------------------------

TEST(Jobs, StreamGivesOutputsInInputOrder) {
  troupe::ordered_runner<jittery_identity> runner{3, [] {
                                                    troupe::config c;
                                                    c.set("sleep_us", std::int64_t{200});
                                                    return c;
                                                  }()};
  std::vector<int> in(3000);
  std::iota(in.begin(), in.end(), 0);
  int expect = 0;
  for (int x : runner.stream(in)) EXPECT_EQ(x, expect++);
  EXPECT_EQ(expect, 3000);
}

/// Whether each item is even: a job whose outputs are `bool`.
struct is_even {
  struct producer {
    bool work(int x) { return x % 2 == 0; }
  };
};

// A stream of bool outputs did not compile: its iterator gave a bool& into a std::vector<bool>.
TEST(Jobs, AStreamOfBoolOutputsGivesEachInOrder) {
  troupe::ordered_runner<is_even> runner{2};
  std::vector<int> in(1000);
  std::iota(in.begin(), in.end(), 0);
  int i = 0;
  for (bool even : runner.stream(in)) EXPECT_EQ(even, i++ % 2 == 0);
  EXPECT_EQ(i, 1000);
}

/// 1 KiB items, passed through.
struct kib_items {
  struct producer {
    std::vector<char> work(std::vector<char> x) { return x; }
  };
};

TEST(Jobs, MemoryBoundStreamWithASlowReader) {
  troupe::ordered_runner<kib_items> runner{2};
  constexpr std::int64_t n = 1'000'000;  // 1 GiB in all
  auto before = peak_rss_kib();
  std::int64_t i = 0, read = 0, bytes = 0;
  auto gen = troupe::generate([&]() -> std::optional<std::vector<char>> {
    if (i == n) return std::nullopt;
    return std::vector<char>(1024, static_cast<char>(i++ % 100));
  });
  for (auto& x : runner.stream(gen)) {
    ASSERT_EQ(x.size(), 1024u);
    ASSERT_EQ(x[0], static_cast<char>(read % 100));  // in order
    bytes += static_cast<std::int64_t>(x.size());
    if (++read % 4096 == 0) std::this_thread::sleep_for(1ms);  // slower than the producers
  }
  EXPECT_EQ(read, n);
  auto growth_mib = (peak_rss_kib() - before) / 1024;
  std::cout << "peak RSS growth streaming 1 GiB: " << growth_mib << " MiB\n";
  EXPECT_LT(growth_mib, 256u);
}

TEST(Jobs, LeavingAStreamEarlyCancelsTheRest) {
  reset_counters();
  troupe::ordered_runner<napper> runner{2, sleep_us(100)};
  std::int64_t seen = 0;
  {
    auto s = runner.stream(counted(1'000'000));
    for (auto y : s) {
      EXPECT_EQ(y, seen * seen);
      if (++seen == 100) break;
    }
  }
  auto after = pulled.load();
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(pulled.load(), after);
  EXPECT_LT(after, 1'000'000);
  EXPECT_EQ(runner.run(iota(100)), sum_of_squares(100));
}

TEST(Jobs, AStreamThrowsTheJobsErrorAfterItsOutputs) {
  troupe::ordered_runner<throws_on_item> runner{1};
  std::vector<std::int64_t> in(100);
  std::iota(in.begin(), in.end(), 0);
  // throws_on_item throws on 42
  std::int64_t got = 0;
  try {
    for (auto y : runner.stream(in)) {
      (void)y;
      ++got;
    }
    ADD_FAILURE() << "no error";
  } catch (const troupe::work_error& e) {
    EXPECT_EQ(e.index(), 42u);
  }
  EXPECT_LE(got, 42);
}

// -- fair share ---------------------------------------------------------------------------------

TEST(Jobs, ASmallJobIsNotQueuedBehindABigOne) {
  reset_counters();
  troupe::unordered_runner<napper> runner{2, sleep_us(100)};
  auto big = runner.submit(counted(200'000));  // ~10 s of work
  while (big.progress().done == 0 && !big.wait_for(5ms)) {
  }
  EXPECT_EQ(runner.run(iota(10)), sum_of_squares(10));
  // The small job finished while the big one had done only a small part of its items.
  EXPECT_FALSE(big.done());
  EXPECT_LT(big.progress().done, 100'000u);
  big.cancel();
}

}  // namespace
