// One pool, many jobs: submit() from several threads, job handles, cancel, deadlines, streams,
// error policies (skip, retry) and quarantine. No timing thresholds: counters and the order of
// events (a test that would hang is caught by CTest's timeout).
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

// -- error policies -----------------------------------------------------------------------------

/// Throws on items with x % 100 == 42 (1 %).
struct one_percent_bad {
  struct producer {
    std::int64_t work(std::int64_t x) {
      if (x % 100 == 42) throw std::runtime_error("bad item " + std::to_string(x));
      return x;
    }
  };
};

template <class Runner>
void skip_reports_exactly_the_bad_items() {
  Runner runner{2};
  auto h = runner.submit(iota(20'000),
                         {std::chrono::milliseconds{0}, 1, troupe::error_policy::skip(), {}});
  auto out = h.get();
  std::vector<std::int64_t> want;
  for (std::int64_t x = 0; x < 20'000; ++x)
    if (x % 100 != 42) want.push_back(x);
  if (std::is_same<Runner, troupe::unordered_runner<one_percent_bad>>::value)
    std::sort(out.begin(), out.end());
  EXPECT_EQ(out, want);  // in order on the ordered runner
  auto r = h.report();
  ASSERT_EQ(r.failures.size(), 200u);
  for (std::size_t k = 0; k < r.failures.size(); ++k) {
    EXPECT_EQ(r.failures[k].index, 100 * k + 42);
    EXPECT_EQ(r.failures[k].attempts, 1u);
    EXPECT_NE(r.failures[k].what.find("bad item " + std::to_string(100 * k + 42)),
              std::string::npos);
    EXPECT_EQ(r.failures[k].where, "cpu");
  }
  EXPECT_EQ(r.delivered, 19'800u);
  EXPECT_EQ(r.items, 20'000u);
}

TEST(Jobs, SkipReportsExactlyTheBadItemsOrdered) {
  skip_reports_exactly_the_bad_items<troupe::ordered_runner<one_percent_bad>>();
}

TEST(Jobs, SkipReportsExactlyTheBadItemsUnordered) {
  skip_reports_exactly_the_bad_items<troupe::unordered_runner<one_percent_bad>>();
}

TEST(Jobs, SkipBeyondMaxFailuresIsAWorkError) {
  troupe::unordered_runner<one_percent_bad> runner{2};
  troupe::job_options o;
  o.on_error = troupe::error_policy::skip(10);
  EXPECT_THROW(runner.run(iota(20'000), o), troupe::work_error);
  EXPECT_EQ(runner.run(iota(10)).size(), 10u);  // the runner goes on
}

/// Throws on the first attempt of every item (whichever producer), works on the second.
std::mutex first_attempts_mtx;
std::set<std::int64_t> first_attempts;
struct fails_first_attempt {
  struct producer {
    std::int64_t work(std::int64_t x) {
      {
        std::lock_guard<std::mutex> guard{first_attempts_mtx};
        if (first_attempts.insert(x).second) throw std::runtime_error("first attempt");
      }
      return x;
    }
  };
};

TEST(Jobs, RetryDeliversEveryItemOnceInOrder) {
  first_attempts.clear();
  troupe::options opts;
  opts.speculative = false;  // a copy's first attempt could lose to the other: counts exact
  troupe::ordered_runner<fails_first_attempt> runner{2, {}, opts};
  troupe::job_options o;
  o.on_error = troupe::error_policy::retry(2);
  auto h = runner.submit(iota(3000), o);
  EXPECT_EQ(h.get(), iota(3000));  // every item once, in input order
  auto r = h.report();
  EXPECT_EQ(r.retries, 3000u);
  EXPECT_TRUE(r.failures.empty());
}

TEST(Jobs, ABackoffOfForeverIsRefusedNotOverflowed) {
  first_attempts.clear();
  troupe::ordered_runner<fails_first_attempt> runner{1};
  troupe::job_options o;
  o.on_error = troupe::error_policy::retry(1, std::chrono::milliseconds::max());
  EXPECT_THROW(runner.submit(iota(10), o), troupe::invalid_argument);
  o.on_error = troupe::error_policy::retry(1, std::chrono::milliseconds{-1});
  EXPECT_THROW(runner.run(iota(10), o), troupe::invalid_argument);
  o.on_error = troupe::error_policy::retry(1, std::chrono::milliseconds{1});
  EXPECT_EQ(runner.run(iota(10), o), iota(10));
}

TEST(Jobs, RetryThenSkipAndRetryExhausted) {
  troupe::ordered_runner<one_percent_bad> runner{2};
  troupe::job_options o;
  o.on_error = troupe::error_policy::retry(2).then_skip();
  auto h = runner.submit(iota(1000), o);
  EXPECT_EQ(h.get().size(), 990u);
  auto r = h.report();
  ASSERT_EQ(r.failures.size(), 10u);
  EXPECT_EQ(r.failures[0].attempts, 3u);
  EXPECT_EQ(r.retries, 20u);
  o.on_error = troupe::error_policy::retry(1);
  try {
    runner.run(iota(1000), o);
    ADD_FAILURE() << "no error";
  } catch (const troupe::work_error& e) {
    EXPECT_EQ(e.index() % 100, 42u);  // the first bad item to fail both attempts
    EXPECT_NE(std::string{e.what()}.find("at each of 2 attempts"), std::string::npos);
  }
}

/// Ordered outputs stay in order while a stuck producer's items go to the others
/// (work_timeout: the producer is replaced) and items are retried after throws.
struct stalls_once_and_throws {
  struct producer {
    std::int64_t work(std::int64_t x) {
      if (x == 500 && !stalled.exchange(true)) std::this_thread::sleep_for(2s);
      {
        std::lock_guard<std::mutex> guard{first_attempts_mtx};
        if (x % 37 == 5 && first_attempts.insert(x).second) throw std::runtime_error("once");
      }
      return x;
    }
    static inline std::atomic<bool> stalled{false};
  };
};

TEST(Jobs, OrderedOutputsStayInOrderAfterRetriesAndAWorkTimeout) {
  first_attempts.clear();
  stalls_once_and_throws::producer::stalled = false;
  troupe::options opts;
  opts.work_timeout = 300ms;
  opts.speculative = false;  // the stuck chunk must be given up on, not overtaken by a copy
  troupe::ordered_runner<stalls_once_and_throws> runner{3, {}, opts};
  troupe::job_options o;
  o.on_error = troupe::error_policy::retry(1);
  auto h = runner.submit(iota(3000), o);
  EXPECT_EQ(h.get(), iota(3000));
  auto r = h.report();
  // 81 items throw once (5, 42, ..., 2965); those whose first attempt was on the stuck
  // producer's chunk (answer dropped) work on their redispatch without a retry.
  EXPECT_LE(r.retries, 81u);
  EXPECT_GE(r.retries, 60u);
  EXPECT_GE(r.redispatched, 1u);
  // The stuck producer is replaced (its replacement reports once constructed).
  for (;;) {
    std::uint64_t restarts = 0;
    for (auto& p : runner.stats().producers) restarts += p.restarts;
    if (restarts >= 1) break;
    std::this_thread::sleep_for(5ms);
  }
}

// -- quarantine ---------------------------------------------------------------------------------

TEST(Jobs, AProducerThatKeepsThrowingIsQuarantined) {
  bad_producers = 0;
  troupe::options opts;
  opts.quarantine_after = 3;
  opts.chunk_size = 1;
  troupe::ordered_runner<one_bad_producer> runner{3, {}, opts};
  troupe::job_options o;
  o.on_error = troupe::error_policy::retry(3);
  EXPECT_EQ(runner.run(iota(500), o), iota(500));
  auto s = runner.stats();
  ASSERT_EQ(s.producers.size(), 3u);
  int quarantined = 0, alive = 0;
  for (auto& p : s.producers) {
    if (p.quarantined) {
      ++quarantined;
      EXPECT_FALSE(p.alive);
      EXPECT_EQ(p.restarts, 0u);  // taken out, not replaced
    }
    alive += p.alive ? 1 : 0;
  }
  EXPECT_EQ(quarantined, 1);  // the bad one (constructed first: any of the three)
  EXPECT_EQ(alive, 2);
  EXPECT_EQ(runner.devices().size(), 2u);  // out of the pool for good: not listed
  // Later jobs run on the others.
  EXPECT_EQ(runner.run(iota(100)), iota(100));
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

namespace {

// Batch producers (docs/api.md, "Batch producers"): work(troupe::span<const In>) is called
// once per chunk with its items; a batch that throws is split in halves down to the items that
// fail alone.
struct batch_squares {
  static inline std::atomic<int> calls{0};
  static inline std::atomic<int> items{0};
  static inline std::atomic<int> wrong_size_at{-1};  // an input that makes work() return too few
  struct producer {
    std::vector<std::int64_t> work(troupe::span<const std::int64_t> xs) {
      ++calls;
      items += static_cast<int>(xs.size());
      std::vector<std::int64_t> ys;
      ys.reserve(xs.size());
      for (auto x : xs) {
        if (x < 0) throw std::runtime_error("negative " + std::to_string(x));
        if (x == wrong_size_at) return ys;
        ys.push_back(x * x);
      }
      return ys;
    }
  };
};

std::vector<std::int64_t> batch_inputs(std::int64_t n, std::vector<std::int64_t> bad = {}) {
  std::vector<std::int64_t> xs(static_cast<std::size_t>(n));
  std::iota(xs.begin(), xs.end(), 0);
  for (auto b : bad) xs[static_cast<std::size_t>(b)] = -b;
  return xs;
}

troupe::options fixed_batches(std::size_t chunk) {
  troupe::options o;
  o.chunk_size = chunk;
  o.speculative = false;  // copies would add calls: this test counts them
  return o;
}

TEST(Batch, AProducerTakesAChunkPerCallAndEveryOutputComesBackInOrder) {
  batch_squares::calls = 0;
  batch_squares::items = 0;
  troupe::ordered_runner<batch_squares> runner{3, {}, fixed_batches(100)};
  auto ys = runner.run(batch_inputs(1000));
  ASSERT_EQ(ys.size(), 1000u);
  for (std::int64_t i = 0; i < 1000; ++i) EXPECT_EQ(ys[static_cast<std::size_t>(i)], i * i);
  EXPECT_EQ(batch_squares::calls, 10) << "one call per chunk of 100";
  EXPECT_EQ(batch_squares::items, 1000);
  EXPECT_EQ(runner.stats().split_calls, 0u);
  // Unordered, adaptive chunks: every output once.
  troupe::unordered_runner<batch_squares> adaptive{2};
  auto zs = adaptive.run(batch_inputs(5000));
  std::sort(zs.begin(), zs.end());
  for (std::int64_t i = 0; i < 5000; ++i) EXPECT_EQ(zs[static_cast<std::size_t>(i)], i * i);
}

TEST(Batch, AThrowingBatchIsSplitUntilOnlyTheItemsThatFailAloneFail) {
  batch_squares::calls = 0;
  troupe::ordered_runner<batch_squares> runner{1, {}, fixed_batches(128)};
  troupe::job_options skip;
  skip.on_error = troupe::error_policy::skip();
  auto h = runner.submit(batch_inputs(128, {37, 80}), skip);
  auto ys = h.get();
  ASSERT_EQ(ys.size(), 126u);
  std::vector<std::int64_t> want;
  for (std::int64_t i = 0; i < 128; ++i)
    if (i != 37 && i != 80) want.push_back(i * i);
  EXPECT_EQ(ys, want);
  auto report = h.report();
  ASSERT_EQ(report.failures.size(), 2u);
  EXPECT_EQ(report.failures[0].index, 37u);
  EXPECT_EQ(report.failures[1].index, 80u);
  EXPECT_NE(report.failures[0].what.find("negative -37"), std::string::npos);
  // One call for the whole chunk, then halves of every batch that throws: 128, and the halves
  // holding a bad item down to 2 items (64, 32, 16, 8, 4, 2 for each): 13 splits, 2 calls each.
  EXPECT_EQ(runner.stats().split_calls, 26u);
  EXPECT_EQ(batch_squares::calls, 1 + 26);
  // Without a policy the job fails with the first item that fails alone, and its index.
  try {
    runner.run(batch_inputs(128, {90}));
    ADD_FAILURE() << "no work_error";
  } catch (const troupe::work_error& e) {
    EXPECT_EQ(e.index(), 90u);
  }
}

TEST(Batch, AProducerThatReturnsTheWrongNumberOfOutputsIsAnError) {
  batch_squares::wrong_size_at = 5;
  troupe::ordered_runner<batch_squares> runner{1, {}, fixed_batches(10)};
  try {
    runner.run(batch_inputs(20));
    ADD_FAILURE() << "no work_error";
  } catch (const troupe::work_error& e) {
    EXPECT_NE(std::string{e.what()}.find("returned 5 outputs for 10 items"), std::string::npos)
        << e.what();
  }
  batch_squares::wrong_size_at = -1;
  EXPECT_EQ(runner.run(batch_inputs(20)).size(), 20u);
}

}  // namespace

namespace {

// options::max_queued_items: submit() beyond the bound throws troupe::overloaded at once.
struct held_squares {
  static inline std::shared_future<void> gate;
  struct producer {
    std::int64_t work(std::int64_t x) {
      gate.wait();
      return x * x;
    }
  };
  using consumer = test_jobs::squares::consumer;
};

TEST(Overload, SubmitBeyondMaxQueuedItemsThrowsOverloadedAtOnceAndCancelFreesRoom) {
  std::promise<void> open;
  held_squares::gate = open.get_future().share();
  troupe::options o;
  o.max_queued_items = 1000;
  o.chunk_size = 10;
  troupe::unordered_runner<held_squares> runner{1, {}, o};
  // The producer holds its first chunk; 2 chunks of 10 are sent to it, the rest waits.
  auto a = runner.submit(test_util::iota(500));
  auto b = runner.submit(test_util::iota(500));
  try {
    runner.submit(test_util::iota(100));
    ADD_FAILURE() << "no overloaded";
  } catch (const troupe::overloaded& e) {
    EXPECT_NE(std::string{e.what()}.find("max_queued_items (1000)"), std::string::npos) << e.what();
  }
  EXPECT_THROW(runner.submit(test_util::iota(1001)), troupe::overloaded) << "larger than the bound";
  EXPECT_EQ(runner.stats().runs, 0u) << "nothing was started or ended by the refusals";
  b.cancel();  // its items no longer wait
  auto c = runner.submit(test_util::iota(400));
  open.set_value();
  EXPECT_EQ(a.get(), test_util::sum_of_squares(500));
  EXPECT_EQ(c.get(), test_util::sum_of_squares(400));
  // Everything is through: the whole bound is free again.
  EXPECT_EQ(runner.run(test_util::iota(1000)), test_util::sum_of_squares(1000));
  // Inputs of unknown size are not counted.
  std::int64_t next = 0;
  EXPECT_EQ(runner.run(troupe::generate([&]() -> std::optional<std::int64_t> {
    if (next == 2000) return std::nullopt;
    return next++;
  })),
            test_util::sum_of_squares(2000));
}

}  // namespace
