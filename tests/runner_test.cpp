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

namespace {

// Pools that change (docs/api.md, "Pools that change"): add_devices and remove_devices while
// jobs run.
struct slot_counting {
  static constexpr std::size_t slots = 8;  // counted modulo: slots beyond share counters
  static inline std::array<std::atomic<int>, slots> work_calls{};
  static inline std::array<std::atomic<int>, slots> ends{};
  static inline std::atomic<int> constructed{0};
  static inline std::atomic<int> fail_construction_at{-1};  // this slot's constructor throws
  static inline std::shared_future<void> hold;  // slot 0 waits here, once, at its first item
  static inline std::int64_t hold_at = -1;      // from this one on
  static inline std::atomic<bool> held{false};
  static inline std::promise<void>* reached = nullptr;  // set when slot 0 reaches it
  static void reset() {
    for (auto& c : work_calls) c = 0;
    for (auto& e : ends) e = 0;
    constructed = 0;
    fail_construction_at = -1;
    hold_at = -1;
    held = false;
    reached = nullptr;
  }
  struct producer {
    producer(const troupe::device&, const troupe::config&, std::size_t index) : index(index) {
      if (static_cast<int>(index) == fail_construction_at) throw std::runtime_error("no weights");
      ++constructed;
    }
    std::int64_t work(std::int64_t x) {
      ++work_calls.at(index % slots);
      if (index == 0 && hold_at >= 0 && x >= hold_at && !held.exchange(true)) {
        if (reached) reached->set_value();
        hold.wait();
      }
      std::this_thread::sleep_for(std::chrono::microseconds{20});
      return x;
    }
    void end() { ++ends.at(index % slots); }
    std::size_t index;
  };
};

troupe::options no_copies(std::size_t chunk = 0) {
  troupe::options o;
  o.speculative = false;  // every work() call is then one item: the counts add up exactly
  o.chunk_size = chunk;
  return o;
}

TEST(Elastic, ProducersAddedWhileAJobRunsTakeWorkInThatJob) {
  test_util::watchdog dog{std::chrono::seconds{60}, "add_devices mid-job"};
  slot_counting::reset();
  std::promise<void> reached, release;
  slot_counting::hold = release.get_future().share();
  slot_counting::reached = &reached;
  slot_counting::hold_at = 100;
  std::vector<troupe::producer_event::kind> events;
  auto opts = no_copies(50);
  opts.on_event = [&](const troupe::producer_event& e) { events.push_back(e.what); };
  troupe::ordered_runner<slot_counting> runner{1, {}, opts};
  auto h = runner.submit(iota(3000));
  reached.get_future().wait();  // the only producer is held inside work(): the job cannot end
  runner.add_devices({"cpu", "cpu"});
  EXPECT_EQ(runner.devices().size(), 3u);
  EXPECT_EQ(slot_counting::constructed, 3);
  // Slot 0 is still held: whatever else is done now was done by the new producers.
  while (slot_counting::work_calls[1] + slot_counting::work_calls[2] < 100)
    std::this_thread::sleep_for(std::chrono::milliseconds{1});
  release.set_value();
  EXPECT_EQ(h.get(), iota(3000)) << "every item once, in input order";
  EXPECT_EQ(
      slot_counting::work_calls[0] + slot_counting::work_calls[1] + slot_counting::work_calls[2],
      3000);
  auto st = runner.stats();
  ASSERT_EQ(st.producers.size(), 3u);
  EXPECT_EQ(st.producers[2].index, 2u);
  EXPECT_GT(st.producers[1].items + st.producers[2].items, 0u);
  runner.close();
  EXPECT_EQ(slot_counting::ends[0] + slot_counting::ends[1] + slot_counting::ends[2], 3);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0], troupe::producer_event::kind::added);
}

TEST(Elastic, RemovedProducersFinishTheirChunksRunEndAndTakeNoMoreWork) {
  test_util::watchdog dog{std::chrono::seconds{60}, "remove_devices mid-job"};
  slot_counting::reset();
  std::promise<void> reached, release;
  slot_counting::hold = release.get_future().share();
  slot_counting::reached = &reached;
  slot_counting::hold_at = 0;  // slot 0 holds a chunk in flight while it is removed
  troupe::ordered_runner<slot_counting> runner{3, {}, no_copies(50)};
  auto h = runner.submit(iota(6000));
  reached.get_future().wait();
  std::atomic<bool> returned{false};
  std::thread remover([&] {
    runner.remove_devices({"cpu"});  // the first cpu: slot 0
    returned = true;
  });
  // remove_devices waits for slot 0's chunk in flight (held in work()).
  std::this_thread::sleep_for(std::chrono::milliseconds{20});
  EXPECT_FALSE(returned) << "remove_devices returned while its producer's chunk was in flight";
  release.set_value();
  remover.join();
  EXPECT_EQ(slot_counting::ends[0], 1) << "remove_devices returned before end() ran";
  int after_removal = slot_counting::work_calls[0];
  EXPECT_EQ(h.get(), iota(6000)) << "nothing lost or twice, in order";
  EXPECT_EQ(slot_counting::work_calls[0], after_removal) << "a removed producer took work";
  EXPECT_EQ(
      slot_counting::work_calls[0] + slot_counting::work_calls[1] + slot_counting::work_calls[2],
      6000);
  EXPECT_EQ(runner.devices(), (std::vector<troupe::device>{"cpu", "cpu"}));
  auto st = runner.stats();
  EXPECT_TRUE(st.producers[0].removed);
  EXPECT_FALSE(st.producers[0].alive);
  // A later job runs on the two left; then the rest end once each at close.
  EXPECT_EQ(runner.run(iota(500)), iota(500));
  EXPECT_EQ(slot_counting::work_calls[0], after_removal);
  runner.close();
  EXPECT_EQ(slot_counting::ends[0], 1);
  EXPECT_EQ(slot_counting::ends[1], 1);
  EXPECT_EQ(slot_counting::ends[2], 1);
}

TEST(Elastic, RollingReplacementUnderARunningJobLosesNothing) {
  // Every producer replaced one by one while an unordered job runs: add one, remove one.
  test_util::watchdog dog{std::chrono::seconds{120}, "rolling replacement"};
  slot_counting::reset();
  troupe::unordered_runner<slot_counting> runner{2, {}, no_copies()};
  auto h = runner.submit(iota(20'000));
  runner.add_devices({"cpu"});
  runner.remove_devices({"cpu"});
  runner.add_devices({"cpu"});
  runner.remove_devices({"cpu"});
  auto out = h.get();
  std::sort(out.begin(), out.end());
  EXPECT_EQ(out, iota(20'000));
  int calls = 0;
  for (auto& c : slot_counting::work_calls) calls += c;
  EXPECT_EQ(calls, 20'000);
  EXPECT_EQ(slot_counting::ends[0], 1);
  EXPECT_EQ(slot_counting::ends[1], 1);
  EXPECT_EQ(runner.devices().size(), 2u);
}

TEST(Elastic, BadChangesThrowForTheNewDevicesOnlyAndChangeNothing) {
  slot_counting::reset();
  troupe::unordered_runner<slot_counting> runner{2, {}, no_copies()};
  EXPECT_THROW(runner.add_devices({"cuda:7"}), troupe::device_unavailable);
  EXPECT_THROW(runner.add_devices({"127.0.0.1:1/cpu"}), troupe::invalid_argument);
  slot_counting::fail_construction_at = 2;
  try {
    runner.add_devices({"cpu", "cpu"});
    ADD_FAILURE() << "no init_error";
  } catch (const troupe::init_error& e) {
    EXPECT_NE(std::string{e.what()}.find("no weights"), std::string::npos) << e.what();
  }
  slot_counting::fail_construction_at = -1;
  EXPECT_EQ(runner.devices().size(), 2u);
  EXPECT_THROW(runner.remove_devices({"cuda:0"}), troupe::invalid_argument);
  EXPECT_THROW(runner.remove_devices({"cpu", "cpu", "cpu"}), troupe::invalid_argument);
  EXPECT_THROW(runner.remove_devices({"cpu", "cpu"}), troupe::invalid_argument)
      << "no producer would be left";
  EXPECT_EQ(runner.devices().size(), 2u);
  auto out = runner.run(iota(1000));
  std::sort(out.begin(), out.end());
  EXPECT_EQ(out, iota(1000));
  runner.add_devices({"cpu"});
  EXPECT_EQ(runner.devices().size(), 3u);
  runner.close();
  EXPECT_THROW(runner.add_devices({"cpu"}), troupe::runner_closed);
  EXPECT_THROW(runner.remove_devices({"cpu"}), troupe::runner_closed);
}

}  // namespace

namespace {

// options::trace_file (docs/api.md, "Watching it run"): Chrome trace events Perfetto loads.
struct trace_event {
  std::string ph, name;
  int pid = 0, tid = 0;
  double ts = 0, dur = 0;
};

/// The events of a trace written one per line (as troupe writes them).
std::vector<trace_event> read_trace(const std::string& path, std::string* text = nullptr) {
  std::ifstream in(path);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text) *text = all;
  std::vector<trace_event> out;
  std::istringstream lines(all);
  std::string line;
  auto field = [](const std::string& l, const std::string& key) -> std::string {
    auto at = l.find("\"" + key + "\":");
    if (at == std::string::npos) return {};
    at += key.size() + 3;
    if (l[at] == '"') return l.substr(at + 1, l.find('"', at + 1) - at - 1);
    return l.substr(at, l.find_first_of(",}", at) - at);
  };
  while (std::getline(lines, line)) {
    if (line.rfind("{\"ph\"", 0) != 0) continue;
    trace_event e;
    e.ph = field(line, "ph");
    e.name = field(line, "name");
    e.pid = std::stoi(field(line, "pid"));
    e.tid = std::stoi(field(line, "tid"));
    if (auto ts = field(line, "ts"); !ts.empty()) e.ts = std::stod(ts);
    if (auto dur = field(line, "dur"); !dur.empty()) e.dur = std::stod(dur);
    out.push_back(e);
  }
  return out;
}

/// python3's json module accepts the file (skipped, true, without python3).
bool valid_json(const std::string& path) {
  if (std::system("command -v python3 >/dev/null 2>&1") != 0) return true;
  auto cmd = "python3 -c 'import json,sys; json.load(open(sys.argv[1]))' " + path;
  return std::system(cmd.c_str()) == 0;
}

TEST(Trace, ALanePerProducerASliceAChunkAndNoOverlapOnALane) {
  auto path = ::testing::TempDir() + "troupe_trace_test.json";
  troupe::options o = no_copies(100);
  o.trace_file = path;
  // A producer preempted on a loaded machine runs late and its chunk's tail is split off: a
  // 101st dispatch (CI saw it). Splits have their own tests; here every chunk is one dispatch.
  o.split_late_chunks = false;
  {
    troupe::unordered_runner<squares> runner{3, {}, o};
    EXPECT_EQ(runner.run(iota(10'000)), test_util::sum_of_squares(10'000));
  }  // the trace is complete once close() (the destructor) has returned
  std::string text;
  auto events = read_trace(path, &text);
  EXPECT_TRUE(valid_json(path)) << text.substr(0, 500);
  int lanes = 0, slices = 0;
  std::map<std::pair<int, int>, std::vector<std::pair<double, double>>> by_lane;
  for (auto& e : events) {
    if (e.ph == "M" && e.name == "thread_name") ++lanes;
    if (e.ph == "X" && e.name == "job 1") {
      ++slices;
      EXPECT_NE(e.tid, 0) << "chunks are on producer lanes";
    }
    // Every slice, the scheduler lane's dispatch slices too (they overlapped once: Perfetto
    // mis-nested them).
    if (e.ph == "X") by_lane[{e.pid, e.tid}].push_back({e.ts, e.ts + e.dur});
  }
  EXPECT_EQ(lanes, 4) << "the scheduler and 3 producers";
  EXPECT_EQ(slices, 100) << "one slice per chunk of 100";
  EXPECT_EQ(by_lane[std::make_pair(1, 0)].size(), 100u) << "a dispatch slice per chunk";
  for (auto& [lane, spans] : by_lane) {
    std::sort(spans.begin(), spans.end());
    for (std::size_t i = 1; i < spans.size(); ++i)
      EXPECT_GE(spans[i].first + 1e-3, spans[i - 1].second) << "overlap on lane " << lane.second;
  }
  EXPECT_NE(text.find("\"dropped_events\":0}"), std::string::npos);
  EXPECT_NE(text.find("job 1 submitted"), std::string::npos);
}

TEST(Trace, EventsPastTheCapAreDroppedCountedAndTheFileStaysValid) {
  auto path = ::testing::TempDir() + "troupe_trace_cap_test.json";
  troupe::options o = no_copies(10);
  o.trace_file = path;
  o.trace_max_bytes = 16 * 1024;
  {
    troupe::unordered_runner<squares> runner{2, {}, o};
    runner.run(iota(20'000));  // 2,000 chunks: far more than 16 KiB of events
  }
  std::string text;
  read_trace(path, &text);
  EXPECT_LE(text.size(), 16u * 1024 + 2048);
  EXPECT_TRUE(valid_json(path));
  EXPECT_EQ(text.find("\"dropped_events\":0}"), std::string::npos) << "nothing was dropped";
  EXPECT_NE(text.find("\"dropped_events\":"), std::string::npos);
  troupe::options bad;
  bad.trace_file = "/nonexistent-dir/trace.json";
  EXPECT_THROW((troupe::unordered_runner<squares>{1, {}, bad}), troupe::invalid_argument);
}

}  // namespace

namespace {

TEST(Elastic, ChangesFromSeveralThreadsWhileJobsRunAndACloseInTheMiddleNeverHang) {
  // Three threads add and remove producers while two threads run jobs; then close() from a
  // fifth thread while they still go on. Every job that returns is exact; every other call
  // ends with runner_closed (or invalid_argument when a removal would leave none); no hang.
  test_util::watchdog dog{std::chrono::seconds{120}, "concurrent add/remove/close"};
  slot_counting::reset();
  troupe::unordered_runner<slot_counting> runner{2, {}, no_copies()};
  std::atomic<bool> stop{false};
  std::atomic<int> exact{0}, closed{0}, other{0}, unexpected{0};
  auto guarded = [&](auto f) {
    try {
      f();
    } catch (const troupe::runner_closed&) {
      ++closed;
    } catch (const troupe::invalid_argument&) {
      ++other;  // a removal that would have left no producer
    } catch (const std::exception& e) {
      ++unexpected;
      ADD_FAILURE() << e.what();
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t)
    threads.emplace_back([&] {
      while (!stop)
        guarded([&] {
          runner.add_devices({"cpu"});
          runner.remove_devices({"cpu"});
        });
    });
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([&] {
      while (!stop)
        guarded([&] {
          auto out = runner.run(iota(2000));
          std::sort(out.begin(), out.end());
          if (out == iota(2000)) ++exact;
        });
    });
  while (exact < 10) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  std::thread closer([&] { runner.close(); });
  closer.join();
  stop = true;
  for (auto& t : threads) t.join();
  EXPECT_GE(exact, 10);
  EXPECT_GT(closed, 0) << "calls after close() must throw runner_closed";
  EXPECT_EQ(unexpected, 0);
  EXPECT_FALSE(runner.is_open());
}

}  // namespace

namespace {

/// A model shared by the producers of a device (one copy of its weights), and producers that
/// warm up before their first chunk: counted.
std::atomic<int> states_made{0}, states_alive{0}, warmups{0}, torn_down_early{0};
struct shared_model_job {
  struct device_state {
    device_state(const troupe::device&, const troupe::config& cfg)
        : weight(cfg.get_or<std::int64_t>("weight", 3)) {
      ++states_made;
      ++states_alive;
    }
    ~device_state() {
      if (producers != 0) ++torn_down_early;  // a producer still held it
      --states_alive;
    }
    std::int64_t weight;
    std::atomic<int> producers{0};
  };
  struct producer {
    producer(const troupe::device&, const troupe::config&, device_state& s) : shared(s) {
      ++shared.producers;
    }
    ~producer() { --shared.producers; }
    void warmup() {
      if (shared.producers == 0) throw std::logic_error("warmup of a producer not constructed");
      warmed = true;
      ++warmups;
    }
    std::int64_t work(std::int64_t x) {
      if (!warmed) throw std::logic_error("work() before warmup()");
      return shared.weight * x * x;
    }
    device_state& shared;
    bool warmed = false;
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

}  // namespace

TEST(Runner, ProducersOfADeviceShareOneDeviceStateAndWarmUpBeforeTheirFirstChunk) {
  troupe::config cfg;
  cfg.set("weight", 5);
  {
    troupe::unordered_runner<shared_model_job> r{troupe::cpus(3), cfg};
    EXPECT_EQ(states_made, 1) << "one device_state per device and process";
    EXPECT_EQ(states_alive, 1);
    EXPECT_EQ(warmups, 3) << "every producer warmed up once, before the constructor returned";
    EXPECT_EQ(r.run(iota(1000)), 5 * test_util::sum_of_squares(1000));
    EXPECT_EQ(r.run(iota(10)), 5 * test_util::sum_of_squares(10));
    EXPECT_EQ(warmups, 3) << "warmup() runs once per producer, not per run";
    std::uint64_t items = 0;
    for (auto& p : r.stats().producers) items += p.items;
    EXPECT_EQ(items, 1010u) << "warmup is not counted as work";
  }
  EXPECT_EQ(states_alive, 0) << "the device_state outlived its runner";
  EXPECT_EQ(torn_down_early, 0) << "the device_state was destroyed before a producer of it";
  // A second runner makes a fresh one (the first was destroyed with its last producer).
  troupe::unordered_runner<shared_model_job> again{troupe::cpus(2), cfg};
  EXPECT_EQ(states_made, 2);
  EXPECT_EQ(again.run(iota(100)), 5 * test_util::sum_of_squares(100));
}

TEST(Runner, RunnersOfAnotherConfigGetADeviceStateOfTheirOwnAndThoseOfTheSameConfigShareOne) {
  // Two runners of one job type alive at once, each with its own model: shared by device
  // alone, the second ran on the first one's model (and a node served one coordinator's model
  // to another).
  auto made = states_made.load();
  troupe::config three, seven;
  three.set("weight", 3);
  seven.set("weight", 7);
  troupe::unordered_runner<shared_model_job> a{troupe::cpus(2), three};
  troupe::unordered_runner<shared_model_job> b{troupe::cpus(2), seven};
  EXPECT_EQ(states_made - made, 2);
  EXPECT_EQ(a.run(iota(100)), 3 * test_util::sum_of_squares(100));
  EXPECT_EQ(b.run(iota(100)), 7 * test_util::sum_of_squares(100));
  troupe::unordered_runner<shared_model_job> c{troupe::cpus(1), seven};
  EXPECT_EQ(states_made - made, 2) << "the same config on the same device: one copy";
  EXPECT_EQ(c.run(iota(100)), 7 * test_util::sum_of_squares(100));
}

namespace {

std::atomic<int> failed_loads{0};
/// A model whose load takes a while and then fails (the weights are not there).
struct unloadable_model_job {
  struct device_state {
    device_state(const troupe::device&, const troupe::config&) {
      ++failed_loads;
      std::this_thread::sleep_for(std::chrono::milliseconds{200});
      throw std::runtime_error("the weights are not there");
    }
  };
  struct producer {
    producer(const troupe::device&, const troupe::config&, device_state&) {}
    std::int64_t work(std::int64_t x) { return x; }
  };
};

}  // namespace

TEST(Runner, ADeviceStateWhoseConstructorThrowsIsNotTriedAgainByTheProducersThatWaitedForIt) {
  // Four producers of one device: each tried the load in turn, and the error came after four
  // times its time. Those that waited for the load now fail with its exception.
  try {
    troupe::unordered_runner<unloadable_model_job> r{troupe::cpus(4)};
    ADD_FAILURE() << "the runner started";
  } catch (const troupe::init_error& e) {
    EXPECT_NE(std::string{e.what()}.find("the weights are not there"), std::string::npos)
        << e.what();
  }
  std::cout << "4 producers, " << failed_loads << " load(s) tried\n";
  // 1 when the four start within the load's 200 ms (as they do); a producer whose thread came
  // only after the failure would try again: fewer than four in any case (four before).
  EXPECT_LT(failed_loads, 4) << "the producers that waited for the load tried it again";
  // A later runner tries again (the weights may be there now).
  auto before = failed_loads.load();
  EXPECT_THROW(troupe::unordered_runner<unloadable_model_job>{troupe::cpus(1)}, troupe::init_error);
  EXPECT_EQ(failed_loads, before + 1);
}

namespace {

/// A device_state whose constructor waits (up to 5 s) for another device's to be running at
/// the same time: how many were inside at once.
struct rendezvous_state {
  rendezvous_state(const troupe::device&, const troupe::config&) {
    std::unique_lock<std::mutex> lock{mtx};
    most = std::max(most, ++inside);
    cv.notify_all();
    cv.wait_for(lock, std::chrono::seconds{5}, [] { return most >= 2; });
    --inside;
  }
  static inline std::mutex mtx;
  static inline std::condition_variable cv;
  static inline int inside = 0, most = 0;
};

}  // namespace

TEST(Runner, DeviceStatesOfDifferentDevicesAreMadeAtTheSameTime) {
  // Each device's model loads at once with the others' (one lock per device, not one per job
  // type: 8 GPUs loaded their weights one after another).
  std::thread other{
      [] { troupe::detail::device_state_for<rendezvous_state>(troupe::device{"cuda:1"}, {}); }};
  auto cpu = troupe::detail::device_state_for<rendezvous_state>(troupe::device{"cpu"}, {});
  other.join();
  EXPECT_EQ(rendezvous_state::most, 2) << "the second device's state waited for the first's";
  // The same device still gets the one it has.
  EXPECT_EQ(troupe::detail::device_state_for<rendezvous_state>(troupe::device{"cpu"}, {}), cpu);
}

namespace {

/// A batch producer that records how many items each call got; `call_ms` of fixed cost per
/// call (a kernel launch, a forward pass), nothing per item.
struct recorded_calls_job {
  struct producer {
    explicit producer(const troupe::device&, const troupe::config& cfg)
        : call_ms(cfg.get_or<std::int64_t>("call_ms", 0)) {}
    std::vector<std::int64_t> work(troupe::span<const std::int64_t> xs) {
      if (call_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds{call_ms});
      {
        std::lock_guard<std::mutex> guard{mtx};
        sizes.push_back(xs.size());
        first_of_thread.emplace(std::this_thread::get_id(), xs.size());  // the first one stays
      }
      std::vector<std::int64_t> out;
      out.reserve(xs.size());
      for (auto x : xs) out.push_back(x * x);
      return out;
    }
    std::int64_t call_ms;
    static inline std::mutex mtx;
    static inline std::vector<std::size_t> sizes;
    static inline std::map<std::thread::id, std::size_t> first_of_thread;
    static std::vector<std::size_t> take() {
      std::lock_guard<std::mutex> guard{mtx};
      first_of_thread.clear();
      return std::exchange(sizes, {});
    }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

}  // namespace

TEST(Runner, ANewJobStartsOnSmallChunksWhateverTheJobsBeforeIt) {
  // The chunk sizer's model is per job: after a job of trivial items whose chunks grew large,
  // the next job's first chunks hold one item each (its items may cost far more), and grow
  // from that job's own answers.
  troupe::options o;
  o.speculative = false;
  troupe::unordered_runner<recorded_calls_job> r{troupe::cpus(2), {}, o};
  EXPECT_EQ(r.run(iota(300'000)), test_util::sum_of_squares(300'000));
  auto first = recorded_calls_job::producer::take();
  EXPECT_GE(*std::max_element(first.begin(), first.end()), 1000u) << "chunks never grew";
  EXPECT_EQ(r.run(iota(2'000)), test_util::sum_of_squares(2'000));
  std::map<std::thread::id, std::size_t> firsts;
  {
    std::lock_guard<std::mutex> guard{recorded_calls_job::producer::mtx};
    firsts = recorded_calls_job::producer::first_of_thread;
  }
  auto second = recorded_calls_job::producer::take();
  EXPECT_GT(second.size(), 2u) << "the chunks did not start small";
  ASSERT_EQ(firsts.size(), 2u) << "both producers took part";
  for (auto& [thread, n] : firsts)
    EXPECT_EQ(n, 1u) << "a producer's first chunk of the second job was sized from the first "
                        "job's items";
}

TEST(Runner, ABatchProducersBatchesGrowWhenItsCostIsMostlyPerCall) {
  // 2 ms per call whatever its size: per item that looked like 2 ms per item, and a plain run()
  // of 3,000 items made 3,000 calls of one item. The cost model tells the fixed cost from the
  // per-item one, and the batches grow while that raises the items per second.
  // A call whose 2 ms sleep a loaded machine stretched looks like a cost per item, and the next
  // chunks shrink: up to 3 runs, one of which must reach the mean batch of 64.
  troupe::config cfg;
  cfg.set("call_ms", 2);
  troupe::options o;
  o.speculative = false;
  std::size_t fewest = std::numeric_limits<std::size_t>::max();
  for (int attempt = 0; attempt < 3 && fewest > 3'000u / 64; ++attempt) {
    troupe::unordered_runner<recorded_calls_job> r{troupe::cpus(2), cfg, o};
    EXPECT_EQ(r.run(iota(3'000)), test_util::sum_of_squares(3'000));
    auto calls = recorded_calls_job::producer::take();
    std::size_t items = 0;
    for (auto n : calls) items += n;
    EXPECT_EQ(items, 3'000u);
    std::cout << calls.size() << " calls for 3,000 items (mean batch "
              << static_cast<double>(items) / static_cast<double>(calls.size()) << ")\n";
    fewest = std::min(fewest, calls.size());
  }
  EXPECT_LE(fewest, 3'000u / 64) << "mean batch below 64";
}

TEST(Runner, ABatchProducersChunkOfALentRangeIsOneCallWhateverItsSize) {
  // run() lends the caller's vector to the producers, which read it in blocks of 16 KiB: a
  // batch producer got one call per block (2,048 numbers), each paying its fixed cost again,
  // and a chunk of 5,000 items made three calls.
  troupe::options o;
  o.chunk_size = 5'000;
  troupe::unordered_runner<recorded_calls_job> r{troupe::cpus(1), {}, o};
  auto xs = iota(5'000);
  EXPECT_EQ(r.run(xs), test_util::sum_of_squares(5'000));
  EXPECT_EQ(recorded_calls_job::producer::take(), std::vector<std::size_t>{5'000});
  EXPECT_EQ(r.run(troupe::lend(xs)), test_util::sum_of_squares(5'000));
  EXPECT_EQ(recorded_calls_job::producer::take(), std::vector<std::size_t>{5'000});
}

/// 20,000 items, each work() call counted; items 10,000..10,199 sleep 2 ms (a slow patch).
struct patchy_job {
  static constexpr std::int64_t n = 20'000, slow_from = 10'000, slow_to = 10'200;
  static inline std::array<std::atomic<int>, n> calls{};
  static inline std::mutex mtx;
  static inline std::map<std::thread::id, int> slow_by_thread;
  struct producer {
    std::int64_t work(std::int64_t x) {
      calls[static_cast<std::size_t>(x)] += 1;
      if (x >= slow_from && x < slow_to) {
        std::this_thread::sleep_for(std::chrono::milliseconds{2});
        std::lock_guard<std::mutex> guard{mtx};
        slow_by_thread[std::this_thread::get_id()] += 1;
      }
      return x;
    }
  };
  struct consumer {
    void work(std::int64_t x) { sum += x; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

TEST(Runner, ALateChunksItemsNotStartedGoToTheIdleProducerAndEachRunsOnce) {
  // A chunk sized for trivial items that holds the slow patch: the producer that falls idle
  // takes back the items the other has not started (options::split_late_chunks), instead of a
  // speculative copy of the whole chunk. Every item's work() runs exactly once, in every run.
  // That the patch is shared depends on the machine's scheduling (under a loaded CI machine
  // one run of many once saw no split): up to 3 runs, one of which must share it.
  bool shared = false;
  for (int attempt = 0; attempt < 3 && !shared; ++attempt) {
    for (auto& c : patchy_job::calls) c = 0;
    {
      std::lock_guard<std::mutex> guard{patchy_job::mtx};
      patchy_job::slow_by_thread.clear();
    }
    auto path = ::testing::TempDir() + "troupe_trace_split_test.json";
    troupe::options o;
    o.trace_file = path;
    // Splits alone: a speculative copy is for a producer that started nothing for 10 target
    // chunk times, which a thread starved by a loaded CI machine can look like (it did once).
    o.speculative = false;
    troupe::unordered_runner<patchy_job> r{troupe::cpus(2), {}, o};
    EXPECT_EQ(r.run(iota(patchy_job::n)), patchy_job::n * (patchy_job::n - 1) / 2);
    auto s = r.stats();
    std::cout << s.split_chunks << " chunks split, " << s.moved_items << " items moved, "
              << s.duplicated_items << " duplicated\n";
    for (std::size_t i = 0; i < patchy_job::calls.size(); ++i)
      ASSERT_EQ(patchy_job::calls[i].load(), 1) << "item " << i;
    EXPECT_EQ(s.duplicated_items, 0u);
    r.close();  // the trace is complete
    std::string text;
    auto events = read_trace(path, &text);
    auto splits = std::count_if(events.begin(), events.end(), [](const trace_event& e) {
      return e.ph == "i" && e.name == "split";
    });
    EXPECT_EQ(static_cast<std::uint64_t>(splits), s.split_chunks) << "a trace event per split";
    std::lock_guard<std::mutex> guard{patchy_job::mtx};
    shared = s.split_chunks >= 1 && s.moved_items >= 1 && patchy_job::slow_by_thread.size() == 2;
  }
  EXPECT_TRUE(shared) << "in 3 runs, one producer always worked the whole slow patch";
}

struct split_close_job {
  static constexpr std::int64_t n = 20'000, slow_from = 10'000, slow_to = 10'400;
  static inline std::array<std::atomic<int>, n> calls{};
  static inline std::atomic<int> slow_started{0};
  struct producer {
    std::int64_t work(std::int64_t x) {
      calls[static_cast<std::size_t>(x)] += 1;
      if (x >= slow_from && x < slow_to) {
        slow_started += 1;
        std::this_thread::sleep_for(std::chrono::milliseconds{1});
      }
      return x;
    }
  };
  struct consumer {
    void work(std::int64_t x) { sum += x; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

TEST(Runner, ACloseWhileProducersClaimTheItemsOfASplitChunkEndsTheJobAndRunsNoItemTwice) {
  // Two producers claim the items of one late chunk item by item (split_late_chunks) when
  // close() comes from this thread: the claims, the close and the producers' ends race. Every
  // round: close() returns, the job ends (its exact sum, or runner_closed), no item's work()
  // ran twice, and items the job did not finish were not all worked (the close cut it short).
  test_util::watchdog dog{std::chrono::seconds{120}, "close during split-chunk claims"};
  int split_before_close = 0, cut_short = 0;
  for (int round = 0; round < 5; ++round) {
    for (auto& c : split_close_job::calls) c = 0;
    split_close_job::slow_started = 0;
    troupe::options o;
    o.speculative = false;  // splits alone
    troupe::unordered_runner<split_close_job> r{troupe::cpus(2), {}, o};
    auto h = r.submit(iota(split_close_job::n));
    // Into the slow patch (400 items of 1 ms): a chunk is late, and the idle producer claims
    // its items not started, one at a time, beside the other.
    while (split_close_job::slow_started < 40)
      std::this_thread::sleep_for(std::chrono::microseconds{200});
    split_before_close += r.stats().split_chunks > 0 ? 1 : 0;
    r.close();
    bool finished = false;
    try {
      EXPECT_EQ(h.get(), split_close_job::n * (split_close_job::n - 1) / 2);
      finished = true;
    } catch (const troupe::runner_closed&) {
    }
    int worked = 0;
    for (std::size_t i = 0; i < split_close_job::calls.size(); ++i) {
      ASSERT_LE(split_close_job::calls[i].load(), 1) << "item " << i << ", round " << round;
      worked += split_close_job::calls[i].load();
    }
    if (!finished) {
      EXPECT_LT(worked, split_close_job::n) << "runner_closed, yet every item was worked";
      cut_short += 1;
    }
    EXPECT_FALSE(r.is_open());
  }
  EXPECT_GT(split_before_close, 0) << "in 5 rounds the slow patch was never split before close()";
  EXPECT_GT(cut_short, 0) << "in 5 rounds close() never came before the job's end";
}
