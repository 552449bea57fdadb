// Behaviour of the runners (docs/api.md: "Jobs", "Runners", "Options, progress and statistics",
// "Errors").
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <future>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <thread>

#include "test_jobs.hpp"
#include "test_util.hpp"
#include "troupe/detail/job_ops.hpp"

using namespace test_jobs;

using test_util::iota;
using test_util::peak_rss_kib;

namespace {}  // namespace

TEST(Runner, SumOfSquaresOverRange100OnThreeCpus) {
  troupe::unordered_runner<squares> unordered{3};
  EXPECT_EQ(unordered.run(iota(100)), 328350);
  troupe::ordered_runner<squares> ordered{troupe::cpus(3)};
  EXPECT_EQ(ordered.run(iota(100)), 328350);
  EXPECT_EQ(ordered.devices().size(), 3u);
}

TEST(Runner, OrderedRunnerKeepsInputOrder) {
  troupe::config cfg;
  cfg.set("sleep_us", 300);
  troupe::options opts;
  opts.chunk_size = 1;  // many small chunks, so that completion order really varies
  troupe::ordered_runner<jittery_identity> runner{troupe::cpus(3), cfg, opts};
  std::vector<int> in(500);
  std::iota(in.begin(), in.end(), 0);
  EXPECT_EQ(runner.run(in), in);
}

TEST(Runner, UnorderedRunnerDeliversEveryOutputOnce) {
  troupe::config cfg;
  cfg.set("sleep_us", 300);
  troupe::unordered_runner<jittery_identity> runner{troupe::cpus(3), cfg};
  std::vector<int> in(500);
  std::iota(in.begin(), in.end(), 0);
  auto out = runner.run(in);
  std::sort(out.begin(), out.end());
  EXPECT_EQ(out, in);
}

TEST(Runner, SeveralRunsFreshConsumerProducersKeepState) {
  ends = 0;
  constructed = 0;
  {
    troupe::ordered_runner<stateful> runner{troupe::cpus(1)};
    EXPECT_EQ(constructed.load(), 1);
    auto first = runner.run(iota(50));
    EXPECT_EQ(first, std::make_pair(std::int64_t{50}, std::int64_t{50}));
    auto second = runner.run(iota(30));
    // A fresh consumer counts 30; the single producer has now seen 80 items.
    EXPECT_EQ(second, std::make_pair(std::int64_t{30}, std::int64_t{80}));
    EXPECT_EQ(constructed.load(), 1);
    EXPECT_EQ(ends.load(), 0);
  }
  EXPECT_EQ(ends.load(), 1);  // the destructor closed the runner
}

TEST(Runner, EmptyInputGivesConsumerEndOnNothing) {
  troupe::unordered_runner<squares> runner{2};
  EXPECT_EQ(runner.run(std::vector<std::int64_t>{}), 0);
  troupe::ordered_runner<jittery_identity> identity{1};
  EXPECT_TRUE(identity.run(std::vector<int>{}).empty());
}

TEST(Runner, CloseIsIdempotentAndRunAfterCloseThrows) {
  ends = 0;
  troupe::unordered_runner<stateful> runner{troupe::cpus(2)};
  EXPECT_TRUE(runner.is_open());
  runner.close();
  runner.close();
  EXPECT_FALSE(runner.is_open());
  EXPECT_EQ(ends.load(), 2);
  EXPECT_THROW(runner.run({1, 2, 3}), troupe::runner_closed);
  try {
    runner.run({1});
  } catch (const troupe::error& e) {
    EXPECT_EQ(e.code(), troupe::errc::runner_closed);
  }
}

TEST(Runner, InputKinds) {
  troupe::ordered_runner<squares> runner{2};
  EXPECT_EQ(runner.run({1, 2, 3}), 14);
  std::int64_t i = 0;
  EXPECT_EQ(runner.run(troupe::generate([&]() -> std::optional<std::int64_t> {
    if (i == 100) return std::nullopt;
    return i++;
  })),
            328350);
  std::istringstream text{"1 2 3 4"};  // single-pass input iterators
  EXPECT_EQ(runner.run(std::vector<std::int64_t>(std::istream_iterator<std::int64_t>{text},
                                                 std::istream_iterator<std::int64_t>{})),
            30);
  std::istringstream more{"5 6"};
  struct stream_range {
    std::istream& s;
    auto begin() { return std::istream_iterator<std::int64_t>{s}; }
    auto end() { return std::istream_iterator<std::int64_t>{}; }
  } range{more};
  EXPECT_EQ(runner.run(range), 61);
}

TEST(Runner, WorkErrorCarriesIndexAndDeviceAndRunnerStaysUsable) {
  troupe::config cfg;
  cfg.set("bad", 42);
  troupe::ordered_runner<throws_on_item> runner{troupe::cpus(2), cfg};
  std::vector<std::int64_t> in = iota(100);
  std::reverse(in.begin(), in.end());  // the value 42 sits at index 57
  try {
    runner.run(in);
    FAIL() << "expected work_error";
  } catch (const troupe::work_error& e) {
    EXPECT_EQ(e.index(), 57u);
    EXPECT_EQ(e.where(), "cpu");
    EXPECT_NE(std::string{e.what()}.find("cannot handle 42"), std::string::npos) << e.what();
    EXPECT_NE(std::string{e.what()}.find("item 57"), std::string::npos) << e.what();
  }
  EXPECT_EQ(runner.run({1, 2, 3}), 6);  // still usable
}

TEST(Runner, ConsumerErrorThenRunnerStaysUsable) {
  troupe::unordered_runner<consumer_throws> runner{2};
  try {
    runner.run(iota(100));
    FAIL() << "expected consumer_error";
  } catch (const troupe::consumer_error& e) {
    EXPECT_NE(std::string{e.what()}.find("unlucky"), std::string::npos) << e.what();
  }
  EXPECT_EQ(runner.run({1, 2}), 5);
}

TEST(Runner, ConsumerConstructorErrorIsConsumerError) {
  troupe::config cfg;
  cfg.set("fail_consumer", true);
  troupe::unordered_runner<consumer_ctor_throws> runner{troupe::cpus(1), cfg};
  EXPECT_THROW(runner.run({1, 2}), troupe::consumer_error);
  EXPECT_THROW(runner.run({3}), troupe::consumer_error);
  EXPECT_TRUE(runner.is_open());
}

TEST(Runner, ProducerConstructorErrorIsInitErrorAndStartedProducersEnd) {
  init_attempts = 0;
  init_ends = 0;
  try {
    troupe::unordered_runner<second_init_throws> runner{troupe::cpus(3)};
    FAIL() << "expected init_error";
  } catch (const troupe::init_error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("weights not found"), std::string::npos) << what;
    EXPECT_NE(what.find("cpu"), std::string::npos) << what;
  }
  EXPECT_EQ(init_attempts.load(), 3);
  EXPECT_EQ(init_ends.load(), 2);  // the two producers that did start were ended
}

namespace {
struct throwing_range {
  struct iterator {
    using iterator_category = std::input_iterator_tag;
    using value_type = std::int64_t;
    using difference_type = std::ptrdiff_t;
    using pointer = const std::int64_t*;
    using reference = std::int64_t;
    std::int64_t i;
    std::int64_t operator*() const {
      if (i == 50) throw std::out_of_range("input broke at 50");
      return i;
    }
    iterator& operator++() {
      ++i;
      return *this;
    }
    bool operator==(const iterator& o) const { return i == o.i; }
    bool operator!=(const iterator& o) const { return i != o.i; }
  };
  iterator begin() const { return {0}; }
  iterator end() const { return {100}; }
};
}  // namespace

TEST(Runner, InputThatThrowsMidwayReachesTheCaller) {
  troupe::ordered_runner<squares> runner{2};
  EXPECT_THROW(runner.run(throwing_range{}), std::out_of_range);
  EXPECT_EQ(runner.run({2}), 4);
}

namespace costly {
/// A document whose cost is its token count (troupe_cost), as users state one.
struct doc {
  std::int64_t tokens = 0;
};
double troupe_cost(const doc& d) {
  if (d.tokens < 0) throw std::domain_error("a document with a negative token count");
  return static_cast<double>(d.tokens);
}
struct token_sum {
  struct producer {
    std::int64_t work(const doc& d) { return d.tokens; }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};
}  // namespace costly

TEST(Runner, ATroupeCostThatThrowsFailsTheJobWithItsExceptionAsAnInputThatThrows) {
  troupe::unordered_runner<costly::token_sum> runner{2};
  std::vector<costly::doc> docs(1000, costly::doc{3});
  docs[500].tokens = -1;
  EXPECT_THROW(runner.run(docs), std::domain_error);
  docs[500].tokens = 3;
  EXPECT_EQ(runner.run(docs), 3000);
}

TEST(Runner, BadDeviceListsAreClearErrors) {
  EXPECT_THROW(troupe::unordered_runner<squares>(std::vector<troupe::device>{}),
               troupe::invalid_argument);
  EXPECT_THROW(troupe::unordered_runner<squares>(std::size_t{0}), troupe::invalid_argument);
  try {
    troupe::unordered_runner<squares> r{std::vector<troupe::device>{"gpu:0"}};
    FAIL();
  } catch (const troupe::invalid_argument& e) {
    EXPECT_NE(std::string{e.what()}.find("'gpu:0'"), std::string::npos) << e.what();
  }
}

TEST(Runner, UnusableDeviceIsDeviceUnavailable) {
  if (!troupe::gpus().empty()) GTEST_SKIP() << "this machine has a GPU";
  try {
    troupe::unordered_runner<squares> r{std::vector<troupe::device>{"cpu", "cuda:0"}};
    FAIL();
  } catch (const troupe::device_unavailable& e) {
    EXPECT_NE(std::string{e.what()}.find("cuda:0"), std::string::npos) << e.what();
  }
  // Remote devices need a registered job; this one is not (and nothing is contacted).
  try {
    troupe::unordered_runner<squares> r{std::vector<troupe::device>{"127.0.0.1:1/cpu"}};
    FAIL();
  } catch (const troupe::invalid_argument& e) {
    EXPECT_NE(std::string{e.what()}.find("TROUPE_REGISTER_JOB"), std::string::npos) << e.what();
  }
}

TEST(Runner, ConcurrentRunsAreSerialized) {
  troupe::unordered_runner<squares> runner{2};
  std::vector<std::int64_t> results(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { results[t] = runner.run(iota(1000)); });
  for (auto& th : threads) th.join();
  for (auto r : results) EXPECT_EQ(r, 332833500);
  EXPECT_EQ(runner.stats().runs, 4u);
}

TEST(Runner, StatsAndProgress) {
  std::vector<troupe::progress> seen;
  troupe::options opts;
  opts.on_progress = [&](const troupe::progress& p) { seen.push_back(p); };
  troupe::unordered_runner<squares> runner{troupe::cpus(2), {}, opts};
  EXPECT_EQ(runner.run(iota(1000)), 332833500);
  auto s = runner.stats();
  EXPECT_EQ(s.items, 1000u);
  EXPECT_EQ(s.runs, 1u);
  ASSERT_EQ(s.producers.size(), 2u);
  EXPECT_EQ(s.producers[0].items + s.producers[1].items, 1000u);
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back().done, 1000u);
  ASSERT_TRUE(seen.back().total.has_value());
  EXPECT_EQ(*seen.back().total, 1000u);
}

TEST(Runner, ExplicitChunkSizeAndMaxInFlight) {
  troupe::options opts;
  opts.chunk_size = 3;
  opts.max_in_flight = 3;
  troupe::ordered_runner<jittery_identity> runner{troupe::cpus(2), {}, opts};
  std::vector<int> in(100);
  std::iota(in.begin(), in.end(), 0);
  EXPECT_EQ(runner.run(in), in);
  opts.max_chunk_items = 0;
  EXPECT_THROW(troupe::ordered_runner<jittery_identity>(troupe::cpus(1), {}, opts),
               troupe::invalid_argument);
  opts.max_chunk_items = 65536;
  // A chunk time of "forever" or of nothing is refused, not overflowed inside the sizer.
  for (auto t : {std::chrono::microseconds::max(), std::chrono::microseconds{0},
                 std::chrono::microseconds{-1}}) {
    opts.target_chunk_time = t;
    EXPECT_THROW(troupe::ordered_runner<jittery_identity>(troupe::cpus(1), {}, opts),
                 troupe::invalid_argument);
  }
  opts.target_chunk_time = std::chrono::hours{1};
  troupe::ordered_runner<jittery_identity> hour{troupe::cpus(1), {}, opts};
  EXPECT_EQ(hour.run(in), in);
}

TEST(Runner, ChunkBoundsOfSizeMaxTakeTheWholeInputWithoutReservingIt) {
  // A chunk's room was reserved at its bound: SIZE_MAX threw length_error, 2^40 bad_alloc.
  for (auto n : {std::numeric_limits<std::size_t>::max(), std::size_t{1} << 40}) {
    troupe::options o;
    o.chunk_size = n;
    o.max_chunk_bytes = std::numeric_limits<std::size_t>::max();
    troupe::unordered_runner<squares> r{2, {}, o};
    std::int64_t i = 0;
    EXPECT_EQ(r.run(troupe::generate([&]() -> std::optional<std::int64_t> {
      if (i >= 10) return std::nullopt;
      return i++;
    })),
              285);
    EXPECT_EQ(r.submit(iota(10)).get(), 285);
  }
}

TEST(Runner, DiagnosticsGoThroughTheReplaceableLogger) {
  std::ostringstream captured;
  troupe::set_log_handler([&](troupe::log_level level, const std::string& line) {
    if (level >= troupe::log_level::warn) captured << line << "\n";
  });
  troupe::options opts;
  opts.on_progress = [](const troupe::progress&) { throw std::runtime_error("bad callback"); };
  troupe::unordered_runner<squares> runner{troupe::cpus(1), {}, opts};
  EXPECT_EQ(runner.run({3}), 9);
  troupe::set_log_handler(nullptr);
  EXPECT_NE(captured.str().find("on_progress threw"), std::string::npos) << captured.str();
}

namespace {

struct byte_counter {
  struct producer {
    std::uint64_t work(const std::vector<char>& block) {
      std::uint64_t s = 0;
      for (std::size_t i = 0; i < block.size(); i += 4096)
        s += static_cast<unsigned char>(block[i]);
      return s + block.size();
    }
  };
  struct consumer {
    void work(std::uint64_t x) { total += x; }
    std::uint64_t end() { return total; }
    std::uint64_t total = 0;
  };
};
}  // namespace

// 3 GiB of input (48k items of 64 KiB) through a generator: memory stays bounded.
TEST(Runner, LargeGeneratorInputKeepsMemoryBounded) {
  const std::size_t items = 48 * 1024, size = 64 * 1024;
  auto before = peak_rss_kib();
  troupe::unordered_runner<byte_counter> runner{2};
  std::size_t i = 0;
  auto total = runner.run(troupe::generate([&]() -> std::optional<std::vector<char>> {
    if (i == items) return std::nullopt;
    return std::vector<char>(size, static_cast<char>(i++ % 2));
  }));
  auto growth_mib = (peak_rss_kib() - before) / 1024;
  EXPECT_EQ(total, items * size + (items / 2) * (size / 4096));
  EXPECT_LT(growth_mib, 256u) << "peak memory grew by " << growth_mib << " MiB";
  std::printf("peak growth %zu MiB\n", growth_mib);
}

namespace {

/// Item 7 blocks its producer (as a hung native call would) until the test releases it; the
/// retry on another producer does not block.
struct hangs_once {
  static inline std::promise<void> release;
  static inline std::atomic<bool> hung{false};
  struct producer {
    std::int64_t work(std::int64_t x) {
      if (x == 7 && !hung.exchange(true)) release.get_future().wait();
      return x * x;
    }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

}  // namespace

TEST(Runner, WorkTimeoutGivesUpOnAStuckProducerAndRetriesItsItems) {
  troupe::options opts;
  // 2 s: a healthy producer held that long by a loaded machine would be given up on too.
  opts.work_timeout = std::chrono::milliseconds{2000};
  opts.speculative = false;  // else an idle producer may take the stuck chunk first
  {
    troupe::unordered_runner<hangs_once> runner{2, {}, opts};
    std::vector<std::int64_t> xs(200);
    std::iota(xs.begin(), xs.end(), 0);
    std::int64_t want = 0;
    for (auto x : xs) want += x * x;
    EXPECT_EQ(runner.run(xs), want);  // exactly once, item 7 done by the other producer
    EXPECT_TRUE(hangs_once::hung);
    // The stuck one was given up on and replaced by a fresh producer on the same device (which
    // may still be starting when the run that gave up on it returns).
    for (int i = 0;
         i < 2000 &&
         runner.stats().producers[0].restarts + runner.stats().producers[1].restarts == 0;
         ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    auto s = runner.stats();
    EXPECT_TRUE(s.producers[0].alive && s.producers[1].alive);
    EXPECT_EQ(s.producers[0].restarts + s.producers[1].restarts, 1u);
    EXPECT_EQ(runner.run(std::vector<std::int64_t>{1, 2, 3}), 14);
    hangs_once::release.set_value();  // the native call returns at last; close() ends it
  }
}
