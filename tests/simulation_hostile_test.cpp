// troupe::testing::simulation as a hostile user drives it: handles that outlive it, hangs,
// waits from callbacks, huge speculation, bad scripts; batch producers and drained nodes.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <troupe/testing.hpp>
#include <troupe/troupe.hpp>
#include <vector>

#include "simulation_parts.hpp"
#include "test_jobs.hpp"

// -- what a hostile user found (each was a crash, a wrong answer or a hang) -----------------

namespace {

TEST(Simulation, AHandleThatOutlivesItsSimulationIsAnErrorNotACrash) {
  std::optional<troupe::job_handle<std::int64_t>> h;
  {
    simulation sim{7};
    four_nodes(sim);
    auto r = sim.unordered_runner<squares>(sim.devices());
    h.emplace(r.submit(iota(500)));
  }
  EXPECT_THROW(h->get(), troupe::runner_closed);
  h.reset();
}

TEST(Simulation, AfterAHangTheCallersRangeIsNeverReadAgain) {
  simulation sim{8};
  sim.nodes({"a:1"}, troupe::cpus(1));
  sim.cost_per_item(1ms);
  sim.time_limit(50ms);
  auto xs = std::make_unique<std::vector<std::int64_t>>(iota(2000));
  auto r = sim.unordered_runner<squares>(sim.devices());
  auto h = r.submit(troupe::lend(*xs));
  EXPECT_FALSE(sim.run_until_idle());
  EXPECT_THROW(h.get(), troupe::testing::hang);
  xs.reset();  // the caller frees its range: ASan reports any read after this
  sim.time_limit(std::chrono::hours{1});
  EXPECT_TRUE(sim.run_until_idle());
  auto t = sim.trace();
  EXPECT_NE(t.find("job 1 ended: failed"), std::string::npos) << t;
}

TEST(Simulation, ARunnerMadeAfterItsNodeWasKilledIsANodeError) {
  simulation sim{9};
  four_nodes(sim);
  sim.at_chunk(1).kill("a:1");
  {
    auto r1 = sim.unordered_runner<squares>(sim.devices());
    EXPECT_EQ(r1.run(iota(500)), sum_of_squares(500));
  }
  EXPECT_THROW((void)sim.unordered_runner<squares>(sim.devices()), troupe::node_error);
}

TEST(Simulation, WaitsFromOnProgressAreRefusedAndWaitForKeepsItsVirtualTime) {
  simulation sim{10};
  four_nodes(sim);
  sim.cost_per_item(1ms);
  troupe::options o;
  std::optional<troupe::job_handle<std::int64_t>> other;
  int refused = 0;
  o.on_progress = [&](const troupe::progress&) {
    if (!other) return;
    try {
      (void)other->wait_for(10ms);
    } catch (const troupe::invalid_argument&) {
      ++refused;
    }
  };
  auto r = sim.unordered_runner<squares>(sim.devices(), {}, o);
  other.emplace(r.submit(iota(3000)));
  auto start = sim.now();
  EXPECT_FALSE(other->wait_for(1ms));  // 3000 items of 1 ms on 8 producers: not in 1 ms
  EXPECT_LT(sim.now() - start, 5ms);
  EXPECT_EQ(other->get(), sum_of_squares(3000));
  EXPECT_GT(refused, 0);
}

TEST(Simulation, AHugeSpeculationAfterWaitsForASlowNodeInsteadOfSpinning) {
  // The wait until the first chunk is late (speculation_after x its expected time) did not fit
  // the clock's nanoseconds: the wake-up fell in the past, and the scheduler spun on it (here a
  // livelock, the job failing with "cannot end: nothing left to run").
  for (double after : {1e15, std::numeric_limits<double>::infinity()}) {
    simulation sim{7};
    sim.nodes({"a:1", "b:1", "c:1"}, troupe::cpus(2));
    sim.at_chunk(3).slow("a:1", 1000);
    troupe::options o;
    o.speculation_after = after;
    auto r = sim.unordered_runner<squares>(sim.devices(), {}, o);
    EXPECT_EQ(r.run(iota(1000)), sum_of_squares(1000)) << after;
  }
}

TEST(Simulation, BadScriptValuesAreRefusedAndAZeroCostJobIsNoLivelock) {
  simulation sim{11};
  four_nodes(sim);
  EXPECT_THROW(sim.after(1ms).slow("a:1", 1e300), troupe::invalid_argument);
  EXPECT_THROW(sim.jitter(1e300), troupe::invalid_argument);
  EXPECT_THROW(sim.after(1ms).delay("a:1", std::chrono::hours{2}), troupe::invalid_argument);
  EXPECT_THROW(sim.after(std::chrono::nanoseconds::max()), troupe::invalid_argument);
  EXPECT_THROW(sim.after(-1ns), troupe::invalid_argument);
  sim.cost_per_item(0ns);
  sim.livelock_after(10'000'000);
  troupe::options o;
  o.chunk_size = 1;
  auto r = sim.unordered_runner<squares>(sim.devices(), {}, o);
  EXPECT_EQ(r.run(iota(100'000)), sum_of_squares(100'000));
}

TEST(Simulation, ManyShortJobsCostLittle) {
  simulation sim{12};
  sim.nodes({"a:1"}, troupe::cpus(2));
  auto r = sim.unordered_runner<squares>(sim.devices());
  std::int64_t sum = 0;
  for (int i = 0; i < 20'000; ++i) sum += r.run(std::vector<std::int64_t>{2});
  EXPECT_EQ(sum, 80'000);  // quadratic bookkeeping made this take seconds
}

}  // namespace

namespace {

TEST(Simulation, ALivelockedSimulationNeverTouchesARangeFreedBeforeIt) {
  simulation sim{31};
  four_nodes(sim);
  sim.cost_per_item(0ns);  // every event at one instant: reported as a livelock
  sim.livelock_after(20'000);
  troupe::options o;
  o.chunk_size = 1;
  auto r = sim.unordered_runner<squares>(sim.devices(), {}, o);
  {
    std::vector<std::int64_t> xs(100'000, 1);
    EXPECT_THROW(r.run(xs), troupe::testing::hang);
  }  // xs goes first, then the runner, then the simulation: ASan reports any read of it
  EXPECT_NE(sim.trace().find("livelock"), std::string::npos);
}

}  // namespace

namespace {
struct sim_batch_squares {
  struct producer {
    std::vector<std::int64_t> work(troupe::span<const std::int64_t> xs) {
      std::vector<std::int64_t> ys;
      for (auto x : xs) ys.push_back(x * x);
      return ys;
    }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};
}  // namespace

TEST(Simulation, BatchProducersWithBatchingGiveTheLocalResult) {
  simulation sim{11};
  four_nodes(sim);
  troupe::options opts;
  opts.batching.max_items = 8;
  opts.batching.max_delay = std::chrono::microseconds{200};
  auto r = sim.unordered_runner<sim_batch_squares>(sim.devices(), {}, opts);
  EXPECT_EQ(r.run(iota(3000)), sum_of_squares(3000));
  troupe::unordered_runner<sim_batch_squares> local{2, {}, opts};
  EXPECT_EQ(local.run(iota(3000)), sum_of_squares(3000));
}

TEST(Simulation, ADrainedNodesProducersAreRemovedNotLostAndTheResultIsExact) {
  simulation sim{5};
  four_nodes(sim);
  auto events = std::make_shared<std::vector<troupe::producer_event>>();
  troupe::options opts;
  opts.on_event = [events](const troupe::producer_event& e) { events->push_back(e); };
  auto r = sim.ordered_runner<squares_with_merge>(sim.devices(), {}, opts);
  sim.at_chunk(2).drain("b:1");
  EXPECT_EQ(r.run(iota(3000)), sum_of_squares(3000));
  EXPECT_NE(sim.trace().find("drain b:1"), std::string::npos) << sim.trace();
  auto s = r.stats();
  std::size_t removed = 0;
  for (auto& p : s.producers)
    if (p.where.node() == "b:1") {
      EXPECT_TRUE(p.removed);
      removed += 1;
    }
  EXPECT_EQ(removed, 2u);
  for (auto& e : *events) EXPECT_NE(e.what, troupe::producer_event::kind::lost);
  EXPECT_EQ(r.run(iota(100)), sum_of_squares(100)) << "the others go on";
}

namespace {

/// A producer whose every item costs real time on the simulation's thread: 1 ms of spinning.
struct spins {
  struct producer {
    std::int64_t work(std::int64_t x) {
      auto until = std::chrono::steady_clock::now() + 1ms;
      while (std::chrono::steady_clock::now() < until) {
      }
      return x * x;
    }
  };
  using consumer = squares::consumer;
};

}  // namespace

TEST(Simulation, SchedulerTimeCountsTheSchedulersRunsAndNotTheProducersWork) {
  simulation sim{3};
  sim.nodes({"a:1", "b:1"}, troupe::cpus(2));
  auto r = sim.unordered_runner<spins>(sim.devices());
  auto before = sim.scheduler_time();
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(r.run(iota(40)), sum_of_squares(40));
  auto wall = std::chrono::steady_clock::now() - t0;
  auto after = sim.scheduler_time();
  std::uint64_t chunks = 0;
  for (auto& p : r.stats().producers) chunks += p.chunks;
  ASSERT_GT(chunks, 0u);
  // Every chunk is sent by a run of the scheduler and its answer taken by another.
  EXPECT_GE(after.activations - before.activations, chunks);
  EXPECT_GT(after.time, before.time);
  // The producers spun 40 ms on this thread: none of it is the scheduler's.
  EXPECT_LE(after.time - before.time, wall - 40ms);
}
