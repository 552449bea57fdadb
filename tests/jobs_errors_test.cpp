// One pool, many jobs, continued: error policies (skip, retry, backoff) and quarantine.
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

}  // namespace
