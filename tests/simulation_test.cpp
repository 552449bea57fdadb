// troupe::testing::simulation, used the way a user would test their own job: simulated nodes,
// scripted faults, virtual time, the usual runner API; explore() over many seeds.
#include "simulation_parts.hpp"

namespace {

TEST(Simulation, ANodeKilledAtItsThirdChunkAndOneFrozenStillGiveTheExactResult) {
  for (bool ordered : {false, true}) {
    simulation sim{42};
    four_nodes(sim);
    sim.at_chunk(3).kill("a:1");
    sim.after(5ms).freeze("b:1", 2s);  // its chunks are late: idle producers take copies
    auto xs = iota(2000);
    std::int64_t got = 0;
    if (ordered) {
      auto r = sim.ordered_runner<squares>(sim.devices());
      got = r.run(xs);
    } else {
      auto r = sim.unordered_runner<squares>(sim.devices());
      got = r.run(xs);
    }
    EXPECT_EQ(got, sum_of_squares(2000));
    auto trace = sim.trace();
    EXPECT_NE(trace.find("kill a:1"), std::string::npos) << trace;
    EXPECT_NE(trace.find("a:1 lost (killed)"), std::string::npos) << trace;
    EXPECT_NE(trace.find("freeze b:1 for 2000.000 ms"), std::string::npos) << trace;
    EXPECT_NE(trace.find("job 1 ended: ok"), std::string::npos) << trace;
    // Nothing went to a after its loss, and nothing came back from b after its freeze: the
    // job ended on c and d (and on copies of b's late chunks) within the heartbeats' 1.5 s.
    EXPECT_EQ(trace.find("a:1/cpu#0 got", trace.find("a:1 lost")), std::string::npos);
    EXPECT_EQ(trace.find("b:1/cpu#2 answered", trace.find("freeze b:1")), std::string::npos);
    EXPECT_LT(sim.now(), 1500ms);
  }
}

TEST(Simulation, SimulatedNodesDoNotFoldLikeRealOnes) {
  simulation sim{7};
  four_nodes(sim);
  auto xs = iota(2000);
  squares_with_merge::merges = 0;
  auto r = sim.ordered_runner<squares_with_merge>(sim.devices());
  EXPECT_EQ(r.run(xs), sum_of_squares(2000));
  EXPECT_EQ(squares_with_merge::merges, 0);
}

TEST(Simulation, TheSameSeedGivesTheSameTraceAndAnotherSeedAnother) {
  auto once = [](std::uint64_t seed) {
    simulation sim{seed};
    four_nodes(sim);
    sim.at_chunk(3).kill("a:1");
    sim.after(2ms).slow("c:1", 5);
    auto r = sim.unordered_runner<squares>(sim.devices());
    EXPECT_EQ(r.run(iota(500)), sum_of_squares(500));
    return sim.trace();
  };
  auto a = once(7);
  EXPECT_EQ(a, once(7));
  EXPECT_NE(a, once(8));
  EXPECT_GT(std::count(a.begin(), a.end(), '\n'), 20);
}

TEST(Simulation, ExploreFindsAConsumerThatAssumesOrderAndPassesItUnderAnOrderedRunner) {
  auto xs = iota(200);
  auto in_order = [](const troupe::testing::outcome<bool>& o) { return o.value && *o.value; };
  troupe::testing::explore_options eo;
  eo.seeds = 1000;
  eo.ordered = false;
  auto found = troupe::testing::explore<assumes_order>(xs, in_order, eo);
  ASSERT_TRUE(found.has_value()) << "an unordered runner delivered in order in every seed";
  EXPECT_NE(found->trace.find("job 1"), std::string::npos);
  // The failing seed replays: the same trace, the same outcome.
  {
    simulation sim{found->seed};
    sim.draw(eo);
    auto r = sim.unordered_runner<assumes_order>(sim.devices());
    EXPECT_FALSE(r.run(xs));
    EXPECT_EQ(sim.trace(), found->trace);
  }
  eo.ordered = true;
  auto none = troupe::testing::explore<assumes_order>(xs, in_order, eo);
  EXPECT_FALSE(none.has_value()) << "seed " << none->seed << "\n" << none->trace;
}

TEST(Simulation, AProducerThatThrowsAtAnItemIsRetriedElsewhereOrFailsTheJob) {
  {
    simulation sim{1};
    four_nodes(sim);
    sim.producer(0).throws_at_item(17);
    auto r = sim.ordered_runner<squares>(sim.devices());
    troupe::job_options o;
    o.on_error = troupe::error_policy::retry(2);
    EXPECT_EQ(r.run(iota(100), o), sum_of_squares(100));
  }
  {
    simulation sim{1};
    four_nodes(sim);
    for (std::size_t p = 0; p < 8; ++p) sim.producer(p).throws_at_item(17);
    auto r = sim.ordered_runner<squares>(sim.devices());
    try {
      r.run(iota(100));
      ADD_FAILURE() << "no work_error";
    } catch (const troupe::work_error& e) {
      EXPECT_EQ(e.index(), 17u);
    }
  }
}

TEST(Simulation, DeadlinesRunInVirtualTime) {
  simulation sim{3};
  four_nodes(sim);
  sim.cost_per_item(1ms);  // 10,000 items on 8 producers: about 1.25 s of virtual time
  auto r = sim.unordered_runner<squares>(sim.devices());
  troupe::job_options o;
  o.deadline = 100ms;
  EXPECT_THROW(r.run(iota(10'000), o), troupe::deadline_exceeded);
  EXPECT_GE(sim.now(), 100ms);
  EXPECT_LT(sim.now(), 1s);  // the job did not run to its end first
}

TEST(Simulation, EveryNodeLostIsANodeErrorNotAHang) {
  simulation sim{4};
  sim.nodes({"a:1", "b:1"}, troupe::cpus(1));
  sim.at_chunk(2).kill("a:1");
  sim.after(1ms).partition("b:1");
  auto r = sim.unordered_runner<squares>(sim.devices());
  EXPECT_THROW(r.run(iota(5000)), troupe::node_error);
  EXPECT_NE(sim.trace().find("b:1 lost (unreachable)"), std::string::npos);
}

TEST(Simulation, SubmitThenRunUntilIdleThenGetAndStreams) {
  simulation sim{5};
  four_nodes(sim);
  sim.after(3ms).freeze("c:1", 200ms);  // shorter than the heartbeats: only a delay
  auto r = sim.ordered_runner<squares>(sim.devices());
  auto h1 = r.submit(iota(300));
  auto h2 = r.submit(iota(400));
  EXPECT_TRUE(sim.run_until_idle());
  EXPECT_TRUE(h1.done());
  EXPECT_EQ(h1.get(), sum_of_squares(300));
  EXPECT_EQ(h2.get(), sum_of_squares(400));
  EXPECT_NE(sim.trace().find("freeze c:1"), std::string::npos);
  EXPECT_EQ(sim.trace().find("c:1 lost"), std::string::npos);
  std::int64_t next = 0;
  for (auto y : r.stream(iota(1000))) {
    EXPECT_EQ(y, next * next);
    ++next;
  }
  EXPECT_EQ(next, 1000);
}

TEST(Simulation, ScriptErrorsAreClear) {
  simulation sim;
  sim.nodes({"a:1"}, troupe::cpus(1));
  EXPECT_THROW(sim.at_chunk(1).kill("zz:1"), troupe::invalid_argument);
  EXPECT_THROW((void)sim.at_chunk(0), troupe::invalid_argument);
  EXPECT_THROW(sim.nodes({"a:1"}, troupe::cpus(1)), troupe::invalid_argument);
  EXPECT_THROW(sim.nodes({"no port"}, troupe::cpus(1)), troupe::invalid_argument);
}

}  // namespace

namespace {

TEST(Simulation, AJobThatCannotEndIsReportedAsAHang) {
  simulation sim{6};
  sim.nodes({"a:1"}, troupe::cpus(1));
  sim.cost_per_item(1ms);
  sim.time_limit(50ms);  // the job needs about 1 s of virtual time
  auto r = sim.unordered_runner<squares>(sim.devices());
  auto h = r.submit(iota(1000));
  EXPECT_FALSE(sim.run_until_idle());
  EXPECT_NE(sim.trace().find("hang: 1 job(s) still running"), std::string::npos) << sim.trace();
  EXPECT_THROW(h.get(), troupe::testing::hang);
}

}  // namespace
