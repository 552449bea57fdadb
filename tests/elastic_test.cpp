// Pools that change while jobs run (docs/api.md, "Pools that change"), and the trace of a run
// (options::trace_file).
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
#include "trace_reader.hpp"
#include "troupe/detail/job_ops.hpp"

using namespace test_jobs;

using test_util::iota;
using test_util::peak_rss_kib;

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

using test_util::read_trace;
using test_util::trace_event;
using test_util::valid_json;

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
