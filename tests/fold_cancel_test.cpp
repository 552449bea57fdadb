// Folding on the producers, continued: a cancel that stops the folding producers, a lent range
// taken back while they fold, the consumers that folded destroyed before get() returns, and a
// speculative copy that lost.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "test_jobs.hpp"
#include "test_util.hpp"
#include "troupe/troupe.hpp"

using test_util::iota;
using test_util::watchdog;
using namespace std::chrono_literals;

namespace {

troupe::options fixed_chunks(std::size_t n) {
  troupe::options o;
  o.chunk_size = n;
  return o;
}

/// A consumer that is slow (100 us per output) while `slow` is set, counted on whichever thread
/// it runs.
struct slow_folding {
  static inline std::atomic<bool> slow{true};
  static inline std::atomic<std::uint64_t> calls{0};
  static inline std::atomic<std::uint64_t> merged{0};
  static inline std::atomic<std::uint64_t> made{0};
  struct producer {
    std::int64_t work(std::int64_t x) { return x; }
  };
  struct consumer {
    consumer() { ++made; }
    void work(std::int64_t) {
      ++calls;
      ++n;
      if (slow) std::this_thread::sleep_for(100us);
    }
    void merge(consumer&& other) { merged += other.n; }
    int end() { return 0; }
    std::uint64_t n = 0;
  };
};

/// A job of slow items cancelled: each folding producer finishes the call under way, takes no
/// further output and makes no consumer for the chunks still queued to it; `fast_before` runs a
/// job of fast items first (the 64-item steps of fast items must not carry over).
void cancel_while_folding(bool fast_before) {
  troupe::unordered_runner<slow_folding> runner{2, {}, fixed_chunks(50)};
  auto xs = iota(1'000'000);
  if (fast_before) {
    slow_folding::slow = false;
    EXPECT_EQ(runner.run(xs), 0);
  }
  slow_folding::slow = true;
  slow_folding::calls = 0;
  slow_folding::merged = 0;
  auto h = runner.submit(troupe::lend(xs));
  while (slow_folding::calls < 500) std::this_thread::sleep_for(1ms);
  h.cancel();
  EXPECT_THROW(h.get(), troupe::cancelled);
  auto at_cancel = slow_folding::calls.load();
  auto made_at_cancel = slow_folding::made.load();
  runner.close();  // every producer's current call has returned
  EXPECT_LE(slow_folding::calls, at_cancel + 2) << "more than the call under way per producer";
  EXPECT_EQ(slow_folding::made, made_at_cancel) << "a consumer made for a chunk of an ended job";
  EXPECT_EQ(h.report().delivered, slow_folding::merged) << "delivered counts what was merged";
  EXPECT_LT(slow_folding::merged, 1'000'000u);
}

TEST(Fold, AfterCancelNoFoldingProducerTakesAnotherOutput) {
  watchdog dog{60s, "cancel while producers fold"};
  cancel_while_folding(false);
}

TEST(Fold, AfterCancelNoFoldingProducerTakesAnotherOutputAfterAJobOfFastItems) {
  watchdog dog{60s, "cancel while producers fold, after fast items"};
  cancel_while_folding(true);
}

/// A lent range taken back while producers fold it: poisoned once the handle is gone, and a
/// producer that read it afterwards would see the poison.
struct folds_and_watches {
  static constexpr std::int64_t poison = -7;
  static inline std::atomic<int> saw_poison{0};
  struct producer {
    std::int64_t work(std::int64_t x) {
      if (x == poison) ++saw_poison;
      return x;
    }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    void merge(consumer&& other) { sum += other.sum; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

TEST(Fold, ALentRangeTakenBackIsNotReadByFoldingProducers) {
  watchdog dog{60s, "a lent range taken back while folding"};
  folds_and_watches::saw_poison = 0;
  troupe::unordered_runner<folds_and_watches> runner{2};
  for (int i = 0; i < 30; ++i) {
    auto ys = iota(4'000'000);
    {
      auto h = runner.submit(troupe::lend(ys));
      std::this_thread::sleep_for(std::chrono::microseconds{100 * (i % 5)});
    }  // destroyed mid-run: cancelled, and the range taken back
    std::fill(ys.begin(), ys.end(), folds_and_watches::poison);
  }
  auto xs = iota(1000);
  EXPECT_EQ(runner.run(xs), 499'500);
  EXPECT_EQ(folds_and_watches::saw_poison, 0) << "a producer read a range after it was back";
}

/// Counts its objects; the destructor throws (when `throws` is set) and takes a little while,
/// so that one destroyed late would still be alive when get() returns.
struct counted_parts {
  static inline std::atomic<int> alive{0};
  static inline std::atomic<bool> throws{false};
  static inline std::string fail;  // "", "work" (consumer::work on a producer), "producer"
  struct producer {
    std::int64_t work(std::int64_t x) {
      if (fail == "producer" && x == 7000) throw std::runtime_error("producer says no");
      return x;
    }
  };
  struct consumer {
    consumer() { ++alive; }
    consumer(const consumer&) = delete;
    ~consumer() noexcept(false) {
      std::this_thread::sleep_for(200us);
      --alive;
      if (throws) throw std::runtime_error("a destructor that throws");
    }
    void work(std::int64_t y) {
      if (fail == "work" && y == 7000) throw std::runtime_error("consumer says no");
      sum += y;
    }
    void merge(consumer&& other) { sum += other.sum; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

TEST(Fold, EveryConsumerThatFoldedIsDestroyedBeforeASuccessfulGetReturns) {
  watchdog dog{60s, "folded consumers destroyed in time"};
  auto opts = fixed_chunks(1000);
  opts.speculative = false;  // no copy that could lose (see the next test)
  counted_parts::throws = false;
  counted_parts::fail = "";
  troupe::ordered_runner<counted_parts> runner{2, {}, opts};
  auto xs = iota(20'000);
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(runner.run(xs), 199'990'000);
    EXPECT_EQ(counted_parts::alive, 0) << "run " << i;
  }
}

TEST(Fold, AConsumerDestructorThatThrowsOnAProducerIsIgnored) {
  watchdog dog{60s, "folded consumers whose destructor throws"};
  counted_parts::throws = true;
  troupe::unordered_runner<counted_parts> runner{2, {}, fixed_chunks(1000)};
  auto xs = iota(20'000);
  counted_parts::fail = "";
  EXPECT_EQ(runner.run(xs), 199'990'000);
  counted_parts::fail = "work";  // the chunk's consumer is destroyed on its producer
  EXPECT_THROW(runner.run(xs), troupe::consumer_error);
  counted_parts::fail = "producer";
  EXPECT_THROW(runner.run(xs), troupe::work_error);
  counted_parts::fail = "";
  auto h = runner.submit(xs);
  h.cancel();
  try {
    h.get();
  } catch (const troupe::cancelled&) {
  }
  EXPECT_EQ(runner.run(xs), 199'990'000);
  runner.close();
  counted_parts::throws = false;
}

/// A speculative copy that loses: producer 0 is held in its first item 500 until the job's
/// get() has returned (another producer took the late chunk's unclaimed items, and a copy of
/// the claimed ones), then goes on.
struct held_once {
  static inline std::atomic<bool> held{false};
  static inline std::atomic<std::uint64_t> calls{0};
  static inline std::promise<void>* release = nullptr;
  struct producer {
    std::int64_t work(std::int64_t x) {
      if (x == 500 && !held.exchange(true)) release->get_future().wait();
      return x;
    }
  };
  struct consumer {
    void work(std::int64_t y) {
      ++calls;
      sum += y;
    }
    void merge(consumer&& other) { sum += other.sum; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

TEST(Fold, ASpeculativeCopyThatLostStopsFolding) {
  watchdog dog{60s, "a speculative copy that lost"};
  std::promise<void> release;
  held_once::release = &release;
  held_once::held = false;
  held_once::calls = 0;
  troupe::unordered_runner<held_once> runner{2, {}, fixed_chunks(1000)};
  std::vector<std::int64_t> xs = iota(4000);
  EXPECT_EQ(runner.run(std::vector<std::int64_t>(xs)), 7'998'000);  // not lent: no lease to stop it
  // The held chunk is cut like any other: the items its producer had not claimed go to the other
  // producer (split), only the ones it had are copied. Before folded chunks were cut, the whole
  // chunk of 1000 was copied.
  EXPECT_GE(runner.stats().split_chunks, 1u);
  EXPECT_GE(runner.stats().duplicated_items, 1u);
  EXPECT_LT(runner.stats().duplicated_items, 1000u);
  auto at_return = held_once::calls.load();
  release.set_value();
  runner.close();
  // The item under way, and the rest of its step of 64 (fast items are checked every 64);
  // without the check the copy that lost went on to the end of its chunk (+500).
  EXPECT_LE(held_once::calls, at_return + 64) << "the copy that lost went on folding";
}

}  // namespace
