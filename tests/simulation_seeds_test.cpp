// The real scheduler under thousands of seeded simulated schedules (troupe::testing::simulation),
// and the mistakes planted in it that those schedules must catch.
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

#include "sim_access.hpp"
#include "simulation_parts.hpp"
#include "test_jobs.hpp"

// -- the real scheduler under thousands of seeded schedules ----------------------------------

namespace {

/// Every output the consumers saw, all jobs of one simulation, in the order they saw them.
/// What the schedules ended with, over all seeds (printed: a run that checks nothing shows).
std::map<std::string, std::size_t>& outcomes() {
  static std::map<std::string, std::size_t> counts;
  return counts;
}

std::vector<std::int64_t>& seen_log() {
  static std::vector<std::int64_t> log;
  return log;
}

constexpr std::int64_t job_stride = 1'000'000;  ///< item i of job tag t is t * job_stride + i

struct checked {
  struct producer {
    std::int64_t work(std::int64_t x) { return x; }
  };
  struct consumer {
    void work(std::int64_t y) { seen_log().push_back(y); }
    bool end() { return true; }
  };
};

struct planned_job {
  std::int64_t tag = 0;
  std::int64_t n = 0;
  troupe::job_options o;
  std::string policy;
};

/// One seed: nodes, faults, options, jobs and throwing items drawn from it; every job must end
/// (no hang), and each one's outputs are checked against what its script allows.
std::string check_one_schedule(
    std::uint64_t seed, troupe::detail::planted_bug bug = troupe::detail::planted_bug::none) {
  std::mt19937_64 rng{seed * 7919 + 17};
  auto pick = [&](std::uint64_t n) { return rng() % n; };
  simulation sim{seed};
  troupe::detail::sim_access::plant(sim, bug);
  troupe::testing::explore_options eo;
  eo.nodes = 1 + pick(4);
  eo.producers_per_node = 1 + pick(3);
  eo.cost_per_item = std::chrono::microseconds{10 + pick(500)};
  sim.draw(eo);
  troupe::options opts;
  if (pick(3) != 0) opts.chunk_size = 1 + pick(16);
  opts.speculative = pick(2) == 0;
  opts.consumer_backlog = 1 + pick(8);
  if (pick(4) == 0) opts.reorder_window = 1 + pick(8);
  if (pick(5) == 0) opts.work_timeout = std::chrono::milliseconds{20 + pick(200)};
  bool ordered = pick(2) == 0;
  auto producers = eo.nodes * eo.producers_per_node;
  std::set<std::uint64_t> throwing;  // item indices that throw on some producer
  if (pick(3) == 0)
    for (std::uint64_t k = 0, m = 1 + pick(3); k < m; ++k) {
      auto item = pick(300);
      throwing.insert(item);
      for (std::size_t p = 0; p < producers; ++p)
        if (pick(2) == 0) sim.producer(p).throws_at_item(item);
    }
  std::vector<planned_job> plan(1 + pick(4));
  for (std::size_t j = 0; j < plan.size(); ++j) {
    auto& pj = plan[j];
    pj.tag = static_cast<std::int64_t>(j + 1);
    pj.n = static_cast<std::int64_t>(pick(301));
    switch (pick(4)) {
      case 0:
        pj.policy = "fail";
        break;
      case 1:
        pj.policy = "retry";
        pj.o.on_error = troupe::error_policy::retry(1 + static_cast<unsigned>(pick(2)));
        break;
      case 2:
        pj.policy = "skip";
        pj.o.on_error = troupe::error_policy::skip();
        break;
      default:
        pj.policy = "retry.then_skip";
        pj.o.on_error = troupe::error_policy::retry(1).then_skip();
        break;
    }
    if (pick(7) == 0) pj.o.deadline = std::chrono::milliseconds{1 + pick(50)};
  }
  seen_log().clear();
  std::ostringstream why;
  auto fail = [&](const std::string& what) {
    why << "seed " << seed << ": " << what << " (" << (ordered ? "ordered" : "unordered")
        << ", nodes " << eo.nodes << "x" << eo.producers_per_node << ", chunk_size "
        << opts.chunk_size << ", speculative " << opts.speculative << ", backlog "
        << opts.consumer_backlog << ", window " << opts.reorder_window << ", work_timeout "
        << opts.work_timeout.count() << " ms)\n";
  };
  auto run_all = [&](auto& runner) {
    std::vector<troupe::job_handle<bool>> handles;
    for (auto& pj : plan) {
      std::vector<std::int64_t> xs(static_cast<std::size_t>(pj.n));
      for (std::int64_t i = 0; i < pj.n; ++i)
        xs[static_cast<std::size_t>(i)] = pj.tag * job_stride + i;
      handles.push_back(runner.submit(std::move(xs), pj.o));
    }
    if (!sim.run_until_idle()) fail("a job never ended");
    for (std::size_t j = 0; j < plan.size(); ++j) {
      auto& pj = plan[j];
      std::vector<std::int64_t> mine;
      for (auto y : seen_log())
        if (y / job_stride == pj.tag) mine.push_back(y % job_stride);
      std::set<std::int64_t> distinct(mine.begin(), mine.end());
      auto name =
          "job " + std::to_string(pj.tag) + " (" + pj.policy + ", " + std::to_string(pj.n) +
          " items" +
          (pj.o.deadline.count() ? ", deadline " + std::to_string(pj.o.deadline.count()) + " ms"
                                 : "") +
          ")";
      if (distinct.size() != mine.size()) fail(name + ": an output reached the consumer twice");
      if (ordered && !std::is_sorted(mine.begin(), mine.end()))
        fail(name + ": outputs out of order under an ordered runner");
      try {
        handles[j].get();
        outcomes()["ok"] += 1;
        auto report = handles[j].report();
        std::set<std::int64_t> skipped;
        outcomes()["skipped items"] += report.failures.size();
        outcomes()["retries"] += report.retries;
        outcomes()["redispatched items"] += report.redispatched;
        for (auto& f : report.failures) {
          skipped.insert(static_cast<std::int64_t>(f.index));
          if (!throwing.count(f.index)) fail(name + ": skipped an item that never threw");
        }
        if (!skipped.empty() && pj.policy != "skip" && pj.policy != "retry.then_skip")
          fail(name + ": skipped items without a skip policy");
        for (std::int64_t i = 0; i < pj.n; ++i)
          if (distinct.count(i) == skipped.count(i))
            fail(name + ": item " + std::to_string(i) + " neither delivered once nor skipped");
      } catch (const troupe::work_error& e) {
        outcomes()["work_error"] += 1;
        if (!throwing.count(e.index())) fail(name + ": work_error for an item that never threw");
        if (pj.policy == "skip") fail(name + ": work_error under skip()");
      } catch (const troupe::deadline_exceeded&) {
        outcomes()["deadline_exceeded"] += 1;
        if (pj.o.deadline.count() == 0) fail(name + ": deadline_exceeded without a deadline");
      } catch (const troupe::node_error& e) {
        outcomes()["node_error"] += 1;
        if (opts.work_timeout.count() == 0)
          fail(name + ": node_error with a node left and no work_timeout: " + e.what());
      } catch (const std::exception& e) {
        fail(name + ": unexpected " + e.what());
      }
    }
    // Nothing of any job after its end.
    auto before = seen_log().size();
    sim.run_until_idle();
    if (seen_log().size() != before) fail("outputs reached a consumer after the jobs had ended");
  };
  if (ordered) {
    auto r = sim.ordered_runner<checked>(sim.devices(), {}, opts);
    run_all(r);
  } else {
    auto r = sim.unordered_runner<checked>(sim.devices(), {}, opts);
    run_all(r);
  }
  auto t = sim.trace();
  for (const char* event : {" lost (", "heartbeats", "thaw", "slow ", "delay ", "drain "})
    if (t.find(event) != std::string::npos) outcomes()[std::string{"with"} + event] += 1;
  auto out = why.str();
  if (!out.empty()) {
    out += "trace (replay: TROUPE_SIM_SEED=" + std::to_string(seed) + "), last part:\n" +
           t.substr(t.size() > 6000 ? t.size() - 6000 : 0);
  }
  return out;
}

TEST(Simulation, ThousandsOfSeededSchedulesKeepEveryPromise) {
  std::uint64_t first = 0;
  std::uint64_t count = 2000;
  if (auto* s = std::getenv("TROUPE_SIM_SEEDS")) count = std::stoull(s);
  if (auto* s = std::getenv("TROUPE_SIM_FIRST")) first = std::stoull(s);
  if (auto* s = std::getenv("TROUPE_SIM_SEED")) {
    first = std::stoull(s);
    count = 1;
  }
  for (auto seed = first; seed < first + count; ++seed) {
    auto failure = check_one_schedule(seed);
    ASSERT_TRUE(failure.empty()) << failure;
  }
  std::string summary;
  for (auto& [what, n] : outcomes()) summary += what + ": " + std::to_string(n) + "; ";
  std::cout << count << " schedules: " << summary << "\n";
  EXPECT_GT(outcomes()["ok"], count / 2);
}

}  // namespace

namespace {

// The same schedules catch a scheduler that drops a retry or delivers a chunk twice (mistakes
// planted in the real scheduler through its io), within the CI-sized run.
TEST(Simulation, PlantedSchedulerMistakesAreCaughtWithinTwoThousandSeeds) {
  using troupe::detail::planted_bug;
  for (auto bug : {planted_bug::drop_retry, planted_bug::deliver_late_answer}) {
    std::optional<std::uint64_t> caught;
    for (std::uint64_t seed = 0; seed < 2000 && !caught; ++seed)
      if (!check_one_schedule(seed, bug).empty()) caught = seed;
    EXPECT_TRUE(caught.has_value())
        << "planted mistake " << static_cast<int>(bug) << " went unnoticed over 2,000 seeds";
  }
  // A wakeup sent at once when its time has passed livelocked the scheduler in virtual time at
  // seed 11096 (found by 100,000 seeds; fixed): the simulation stops it and reports a hang.
  auto livelock = check_one_schedule(11096, planted_bug::wake_at_once);
  EXPECT_NE(livelock.find("a job never ended"), std::string::npos) << livelock;
  EXPECT_NE(livelock.find("livelock"), std::string::npos) << livelock;
  for (std::uint64_t seed : {88, 376, 11096})  // and without the mistakes, those seeds pass
    EXPECT_TRUE(check_one_schedule(seed).empty()) << check_one_schedule(seed);
}

}  // namespace
