// Dynamic batching across callers (docs/api.md, "Dynamic batching across callers"): 1-item jobs
// of many callers share one work(span) call of a batch producer; a lone request is not delayed
// with max_delay 0; deadlines and cancel() hold while items wait for a batch (they never reach
// a producer); a poisoned item fails only its own job.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <list>
#include <mutex>
#include <set>
#include <thread>
#include <troupe/troupe.hpp>
#include <vector>

#include "test_util.hpp"

using test_util::watchdog;
using namespace std::chrono_literals;

namespace {

using test_util::latch;

/// A model that takes a batch: what every call saw is recorded; the first call can be held on
/// a latch (the producer busy with a batch while requests queue); an item `poison` throws.
struct model {
  static inline std::mutex mtx;
  static inline std::vector<std::size_t> calls;  ///< each call's batch size
  static inline std::multiset<std::int64_t> seen;
  static inline latch* hold_first = nullptr;
  static inline std::atomic<bool> first_started{false};
  static inline std::atomic<std::int64_t> poison{-1};
  static inline std::chrono::microseconds fixed{0}, per_item{0};

  static void reset() {
    std::lock_guard<std::mutex> guard{mtx};
    calls.clear();
    seen.clear();
    hold_first = nullptr;
    first_started = false;
    poison = -1;
    fixed = per_item = std::chrono::microseconds{0};
  }

  struct producer {
    std::vector<std::int64_t> work(troupe::span<const std::int64_t> xs) {
      bool first = false;
      {
        std::lock_guard<std::mutex> guard{mtx};
        first = calls.empty();
        calls.push_back(xs.size());
        for (auto x : xs) seen.insert(x);
      }
      if (first && hold_first) {
        first_started = true;
        hold_first->wait();
      }
      std::this_thread::sleep_for(fixed + per_item * static_cast<int>(xs.size()));
      std::vector<std::int64_t> ys;
      for (auto x : xs) {
        if (x == poison) throw std::runtime_error("poisoned item");
        ys.push_back(x * x);
      }
      return ys;
    }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

troupe::options batched(std::size_t max_items, std::chrono::microseconds delay) {
  troupe::options o;
  o.batching.max_items = max_items;
  o.batching.max_delay = delay;
  o.speculative = false;
  return o;
}

std::size_t seen_count(std::int64_t x) {
  std::lock_guard<std::mutex> guard{model::mtx};
  return model::seen.count(x);
}

void wait_first_started() {
  watchdog dog{60s, "the first batch to start"};
  while (!model::first_started) std::this_thread::sleep_for(1ms);
}

}  // namespace

TEST(Batching, SixtyFourCallersOfOneItemJobsShareCalls) {
  model::reset();
  model::fixed = 2ms;
  model::per_item = 100us;
  troupe::unordered_runner<model> runner{1, {}, batched(8, 2000us)};
  constexpr int callers = 64, each = 20;
  std::atomic<int> wrong{0};
  {
    watchdog dog{120s, "64 callers"};
    std::vector<std::thread> threads;
    for (int c = 0; c < callers; ++c)
      threads.emplace_back([&, c] {
        for (int i = 0; i < each; ++i) {
          std::int64_t x = c * 1000 + i;
          if (runner.run({x}) != x * x) wrong += 1;
        }
      });
    for (auto& t : threads) t.join();
  }
  EXPECT_EQ(wrong, 0);
  std::lock_guard<std::mutex> guard{model::mtx};
  std::size_t items = 0, biggest = 0;
  for (auto n : model::calls) {
    items += n;
    biggest = std::max(biggest, n);
  }
  EXPECT_EQ(items, static_cast<std::size_t>(callers * each));
  EXPECT_LE(biggest, 8u);
  double mean = static_cast<double>(items) / static_cast<double>(model::calls.size());
  EXPECT_GE(mean, 6.0) << model::calls.size() << " calls";
  EXPECT_EQ(runner.stats().batched_calls, model::calls.size());  // every call counted once
  std::cout << callers * each << " one-item jobs in " << model::calls.size()
            << " calls (mean batch " << mean << ")\n";
}

TEST(Batching, WithMaxDelayZeroALoneItemIsSentAtOnce) {
  model::reset();
  troupe::unordered_runner<model> runner{1, {}, batched(8, 0us)};
  watchdog dog{60s, "a lone item"};
  EXPECT_EQ(runner.run({7}), 49);
  std::lock_guard<std::mutex> guard{model::mtx};
  EXPECT_EQ(model::calls, (std::vector<std::size_t>{1}));
}

TEST(Batching, ALoneItemGoesAtAPreferredSizeOrAfterMaxDelay) {
  model::reset();
  {
    // max_delay an hour, but 1 is a preferred size: it goes at once.
    auto o = batched(8, std::chrono::hours{1});
    o.batching.preferred_sizes = {1, 4};
    troupe::unordered_runner<model> runner{1, {}, o};
    watchdog dog{60s, "a lone item at a preferred size"};
    EXPECT_EQ(runner.run({3}), 9);
  }
  {
    troupe::unordered_runner<model> runner{1, {}, batched(8, 20ms)};
    watchdog dog{60s, "a lone item after max_delay"};
    EXPECT_EQ(runner.run({4}), 16);
    // It was held for others until max_delay had passed (never sent early), and stats say so.
    EXPECT_EQ(runner.stats().batched_calls, 1u);
    EXPECT_GE(runner.stats().longest_batch_hold, 20ms);
  }
  std::lock_guard<std::mutex> guard{model::mtx};
  EXPECT_EQ(model::calls, (std::vector<std::size_t>{1, 1}));
  EXPECT_THROW((troupe::unordered_runner<model>{1,
                                                {},
                                                [] {
                                                  auto o = batched(4, 0us);
                                                  o.batching.preferred_sizes = {8};
                                                  return o;
                                                }()}),
               troupe::invalid_argument);
  // A max_delay of "forever" is refused (it overflowed the scheduler's clock arithmetic).
  EXPECT_THROW(
      (troupe::unordered_runner<model>{1, {}, batched(4, std::chrono::microseconds::max())}),
      troupe::invalid_argument);
}

TEST(Batching, ADeadlineEndsARequestWaitingBehindABatchBeforeTheBatchEnds) {
  model::reset();
  latch hold;
  model::hold_first = &hold;
  troupe::unordered_runner<model> runner{1, {}, batched(8, 0us)};
  auto busy = runner.submit(std::vector<std::int64_t>{1});
  wait_first_started();  // the producer is inside its batch, held
  troupe::job_options o;
  o.deadline = 5ms;
  auto late = runner.submit(std::vector<std::int64_t>{2}, o);
  {
    watchdog dog{60s, "the deadline while the batch runs"};
    EXPECT_THROW(late.get(), troupe::deadline_exceeded);
  }
  EXPECT_FALSE(hold.is_open()) << "get() returned only after the batch";
  hold.open();
  EXPECT_EQ(busy.get(), 1);
  EXPECT_EQ(runner.run({3}), 9);
  EXPECT_EQ(seen_count(2), 0u) << "the expired request reached a producer";
}

TEST(Batching, CancelledWaitingRequestsNeverReachAProducerAndTheOthersSucceed) {
  model::reset();
  latch hold;
  model::hold_first = &hold;
  troupe::unordered_runner<model> runner{1, {}, batched(8, 0us)};
  auto busy = runner.submit(std::vector<std::int64_t>{1});
  wait_first_started();
  std::vector<troupe::job_handle<std::int64_t>> handles;
  for (std::int64_t i = 0; i < 20; ++i)
    handles.push_back(runner.submit(std::vector<std::int64_t>{100 + i}));
  for (std::size_t i = 0; i < handles.size(); i += 2) handles[i].cancel();
  hold.open();
  watchdog dog{60s, "the requests after the batch"};
  EXPECT_EQ(busy.get(), 1);
  for (std::size_t i = 0; i < handles.size(); ++i) {
    auto x = 100 + static_cast<std::int64_t>(i);
    if (i % 2 == 0) {
      EXPECT_THROW(handles[i].get(), troupe::cancelled);
      EXPECT_EQ(seen_count(x), 0u) << "cancelled request " << x << " reached a producer";
    } else {
      EXPECT_EQ(handles[i].get(), x * x);
    }
  }
}

TEST(Batching, APoisonedItemInASharedBatchFailsOnlyItsOwnJob) {
  model::reset();
  latch hold;
  model::hold_first = &hold;
  model::poison = 203;
  troupe::unordered_runner<model> runner{1, {}, batched(8, 0us)};
  auto busy = runner.submit(std::vector<std::int64_t>{1});
  wait_first_started();
  std::vector<troupe::job_handle<std::int64_t>> handles;
  for (std::int64_t i = 0; i < 8; ++i)
    handles.push_back(runner.submit(std::vector<std::int64_t>{200 + i}));
  hold.open();
  watchdog dog{60s, "the shared batch"};
  EXPECT_EQ(busy.get(), 1);
  for (std::int64_t i = 0; i < 8; ++i) {
    if (200 + i == 203) {
      try {
        handles[static_cast<std::size_t>(i)].get();
        ADD_FAILURE() << "the poisoned job succeeded";
      } catch (const troupe::work_error& e) {
        EXPECT_EQ(e.index(), 0u);
      }
    } else {
      EXPECT_EQ(handles[static_cast<std::size_t>(i)].get(), (200 + i) * (200 + i));
    }
  }
  std::lock_guard<std::mutex> guard{model::mtx};
  ASSERT_GE(model::calls.size(), 2u);
  EXPECT_EQ(model::calls[1], 8u) << "the 8 waiting requests shared one call";
  EXPECT_GE(runner.stats().split_calls, 1u);
}

TEST(Batching, RunOnACallersVectorIsBatchedToo) {
  // run(xs) reads a caller's range in place (lent): the batcher copies such parts to share the
  // call, so requests made the way most callers write them are batched as well.
  model::reset();
  latch hold;
  model::hold_first = &hold;
  troupe::unordered_runner<model> runner{1, {}, batched(8, 0us)};
  auto busy = runner.submit(std::vector<std::int64_t>{1});
  wait_first_started();
  std::atomic<int> wrong{0}, calling{0};
  std::vector<std::thread> callers;
  for (std::int64_t c = 0; c < 8; ++c)
    callers.emplace_back([&, c] {
      std::vector<std::int64_t> xs{300 + c};  // an lvalue: run() lends it
      calling += 1;
      if (runner.run(xs) != (300 + c) * (300 + c)) wrong += 1;
    });
  {
    watchdog dog{60s, "the callers"};
    while (calling < 8) std::this_thread::sleep_for(1ms);
  }
  // Their requests queue behind the held call (a moment for the last ones to submit; if one is
  // late it gets a call of its own, and the others still share one).
  std::this_thread::sleep_for(50ms);
  hold.open();
  for (auto& t : callers) t.join();
  EXPECT_EQ(busy.get(), 1);
  EXPECT_EQ(wrong, 0);
  std::lock_guard<std::mutex> guard{model::mtx};
  std::size_t biggest = 0;
  for (std::size_t i = 1; i < model::calls.size(); ++i)
    biggest = std::max(biggest, model::calls[i]);
  EXPECT_GT(biggest, 1u) << "lent requests were never batched";
}

// An input of a known size that is empty was never pulled under batching (the batcher counted
// no item waiting and skipped it), so nothing found out that it had ended: run() and the stream
// waited for ever, on local producers (a node's took the other path).
TEST(Batching, AnEmptyInputOfAKnownSizeEndsAtOnceAndCallsNothing) {
  model::reset();
  troupe::ordered_runner<model> runner{2, {}, batched(8, 0us)};
  watchdog dog{60s, "jobs of empty inputs under batching"};
  EXPECT_EQ(runner.run(std::vector<std::int64_t>{}), 0);
  EXPECT_EQ(runner.run(std::list<std::int64_t>{}), 0);
  EXPECT_EQ(runner.submit(std::vector<std::int64_t>{}).get(), 0);
  std::size_t streamed = 0;
  for (auto y : runner.stream(std::vector<std::int64_t>{})) streamed += static_cast<std::size_t>(y);
  EXPECT_EQ(streamed, 0u);
  {
    std::lock_guard<std::mutex> guard{model::mtx};
    EXPECT_TRUE(model::calls.empty());
  }
  EXPECT_EQ(runner.run(std::vector<std::int64_t>{1, 2, 3}), 14);  // and the runner goes on
}

TEST(Batching, AStuckProducersBatchIsCopiedToAFreeOneAndTheJobEnds) {
  // With batching, a free producer with nothing to batch still takes a copy of a late chunk
  // (options::speculative, on by default): a producer stuck in work() does not hold the job.
  model::reset();
  latch hold;
  model::hold_first = &hold;  // the first call, on whichever producer, never returns on its own
  auto o = batched(8, 0us);
  o.speculative = true;
  troupe::unordered_runner<model> runner{2, {}, o};
  {
    watchdog dog{60s, "the job of a stuck producer"};
    EXPECT_EQ(runner.run({5}), 25);
  }
  EXPECT_FALSE(hold.is_open()) << "the job ended only when the stuck call did";
  EXPECT_EQ(runner.stats().duplicated_items, 1u);
  hold.open();
}
