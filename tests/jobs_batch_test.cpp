// Batch producers (docs/api.md, "Batch producers") and a queue bounded by max_queued_items.
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
