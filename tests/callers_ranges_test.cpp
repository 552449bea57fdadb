// Ranges lent to the producers (docs/api.md, "One pool, many jobs"): never read after run()
// returns, read in blocks with the failed items' indices kept, and taken back by a handle
// destroyed before its job ended.
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
