// troupe::data_parallel (docs/api.md, "Training"): identical replicas, equality with a plain
// LibTorch loop, deterministic results whatever the replicas, failures (a throwing backward, a
// node SIGKILLed mid-step, a frozen node), local steps + averaging, save/load, added devices.
#include "train_parts.hpp"

TROUPE_REGISTER_JOB(example::classifier);  // the name the train example (our node) registers
TROUPE_REGISTER_JOB(seeded_classifier);    // the test node (TROUPE_TEST_NODE) registers it too

TEST(Train, ReplicasAreBitIdenticalAfterEveryStep) {
  dp_t dp{{"cpu", "cpu", "cpu"}, small_cfg(), opts(8, false)};
  for (auto& b : make_batches(20, 50)) {  // 50 samples: 7 shards, the last one of 2
    dp.step(b);
    expect_replicas_identical(dp);
  }
  auto s = dp.stats();
  EXPECT_EQ(s.steps, 20u);
  EXPECT_EQ(s.shards, 20u * 7);
  ASSERT_EQ(s.replicas.size(), 3u);
  std::uint64_t shards = 0;
  for (auto& r : s.replicas) shards += r.shards;
  EXPECT_EQ(shards, 20u * 7);  // each shard computed once
  // What observers read (published after each step): the same numbers, without the trainer's
  // lock.
  auto views = troupe::detail::trainers().views();
  ASSERT_EQ(views.size(), 1u);
  EXPECT_EQ(views[0].steps, 20u);
  EXPECT_EQ(views[0].shards, 20u * 7);
  EXPECT_EQ(views[0].replicas, 3u);
  EXPECT_EQ(views[0].lost_replicas, 0u);
#ifdef TROUPE_TEST_METRICS
  auto text = troupe::metrics_text();
  auto id = std::to_string(views[0].id);
  EXPECT_NE(text.find("troupe_train_steps_total{trainer=\"" + id + "\"} 20\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("troupe_train_replicas{trainer=\"" + id + "\"} 3\n"), std::string::npos);
#endif
}

TEST(Train, OneTwoAndThreeReplicasMatchAPlainLibTorchLoop) {
  auto batches = make_batches(50, 48);
  plain_model ref;
  for (auto& b : batches) ref.step(b);
  auto expected = flat(ref.net.parameters()).detach();
  for (std::size_t n = 1; n <= 3; ++n) {
    auto got = trained(troupe::cpus(n), batches, opts(16, false));
    EXPECT_LT(relative_difference(got, expected), 1e-5) << n << " replicas";
  }
}

TEST(Train, DeterministicResultsDoNotDependOnTheReplicasOrTheRun) {
  auto batches = make_batches(30, 52);  // 52 samples, shards of 8: 7 shards, uneven tree
  auto one = trained({"cpu"}, batches, opts(8, true));
  EXPECT_TRUE(same_bits(trained({"cpu", "cpu"}, batches, opts(8, true)), one));
  EXPECT_TRUE(same_bits(trained({"cpu", "cpu", "cpu"}, batches, opts(8, true)), one));
  EXPECT_TRUE(same_bits(trained({"cpu", "cpu", "cpu"}, batches, opts(8, true)), one));
  EXPECT_TRUE(same_bits(trained({"cpu"}, batches, opts(8, true)), one));
  // A slow device takes fewer shards: another split, the same bits.
  auto cfg = small_cfg();
  cfg.set("fault.sleep_ms", 1);
  EXPECT_TRUE(same_bits(trained({"cpu", "cpu"}, batches, opts(8, true), cfg), one));
}

TEST(Train, ReplicasThatSeedTheGlobalGeneratorInTheirConstructorGiveTheSameModelEveryRun) {
  // Local replicas are constructed one at a time, replica 0 first (docs/api.md, "Training"):
  // constructed at once, their draws from the one global generator interleaved and replica 0
  // (whose parameters every replica starts from) was a different model from run to run.
  auto batches = make_batches(20, 48);  // 20 steps, 6 shards of 8
  auto train = [&](std::size_t replicas) {
    troupe::data_parallel<seeded_classifier> dp{troupe::cpus(replicas), small_cfg(), opts(8, true)};
    for (auto& b : batches) dp.step(b);
    return flat(dp.parameters());
  };
  auto one = train(1);
  for (int run = 0; run < 20; ++run)
    ASSERT_TRUE(same_bits(train(3), one)) << "run " << run << " differs from one replica";
}

TEST(Train, AThrowingBackwardFailsTheStepAndLeavesEveryReplicaAsItWas) {
  auto batches = make_batches(4, 64);
  dp_t dp{{"cpu", "cpu"}, small_cfg(), opts(8, true)};
  for (int i = 0; i < 3; ++i) dp.step(batches[i]);
  auto before = dp.replica_parameters();
  auto bad = batches[3];
  bad[37].label = -1;  // shard 4 (samples 32..39) throws
  try {
    dp.step(bad);
    FAIL() << "step() returned";
  } catch (const troupe::work_error& e) {
    EXPECT_EQ(e.index(), 32u);
    EXPECT_EQ(e.where(), "cpu");
    EXPECT_NE(std::string{e.what()}.find("negative label"), std::string::npos) << e.what();
    // Named as the simulation names it.
    EXPECT_EQ(std::string{e.what()}.rfind("replica::backward threw on cpu: ", 0), 0u) << e.what();
  }
  auto after = dp.replica_parameters();
  ASSERT_EQ(after.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) EXPECT_TRUE(same_bits(before[i], after[i]));
  // Training goes on as if the bad batch had never come.
  dp.step(batches[3]);
  EXPECT_TRUE(same_bits(flat(dp.parameters()), trained({"cpu"}, batches, opts(8, true))));
}

TEST(Train, LocalStepsAndAveragingEqualTheSeedsSchemeComputedByHand) {
  // Two replicas, batches of 64 in shards of 16: replica 0 takes samples 0..31, replica 1
  // 32..63; each steps on its own mean gradient; every 2 steps the parameters are averaged.
  auto batches = make_batches(6, 64);
  dp_t dp{{"cpu", "cpu"}, small_cfg(), opts(16, false)};
  plain_model hand[2];
  for (std::size_t i = 0; i < batches.size(); ++i) {
    dp.local_step(batches[i]);
    for (int k = 0; k < 2; ++k)
      hand[k].step({batches[i].begin() + 32 * k, batches[i].begin() + 32 * (k + 1)});
    if (i % 2 == 1) {
      dp.average_parameters();
      torch::NoGradGuard no_grad;
      auto a = hand[0].net.parameters(), b = hand[1].net.parameters();
      for (std::size_t j = 0; j < a.size(); ++j) {
        auto mean = (a[j] + b[j]) / 2;
        a[j].copy_(mean);
        b[j].copy_(mean);
      }
      expect_replicas_identical(dp);
    }
  }
  auto expected = flat(hand[0].net.parameters()).detach();
  EXPECT_LT(relative_difference(flat(dp.parameters()), expected), 1e-5);
}

TEST(Train, SaveAndLoadRoundTripParametersAndOptimizerState) {
  // SGD with momentum, Adam and AdamW, their state carried by the replica's optimizer()
  // accessor alone (no save/load): saved from 2 replicas, loaded into 3.
  auto batches = make_batches(10, 32);
  auto path = testing::TempDir() + "troupe_train_ckpt.pt";
  for (const char* optim : {"sgd", "adam", "adamw"}) {
    SCOPED_TRACE(optim);
    auto cfg = small_cfg();
    cfg.set("optim", std::string{optim});
    dp_t a{{"cpu", "cpu"}, cfg, opts(8, true)};
    for (int i = 0; i < 5; ++i) a.step(batches[i]);
    a.save(path);
    auto saved = flat(a.parameters());
    for (int i = 5; i < 10; ++i) a.step(batches[i]);

    auto other = cfg;
    other.set("model.seed", 99);  // other initial parameters, overwritten by load()
    dp_t b{{"cpu", "cpu", "cpu"}, other, opts(8, true)};
    b.load(path);
    EXPECT_TRUE(same_bits(flat(b.parameters()), saved));
    expect_replicas_identical(b);
    for (int i = 5; i < 10; ++i) b.step(batches[i]);
    // Equal bits only if the momentum buffers (Adam's moments and step counts) came back too.
    EXPECT_TRUE(same_bits(flat(b.parameters()), flat(a.parameters())));
    EXPECT_EQ(b.stats().fresh_state_joins, 0u);
  }
  std::remove(path.c_str());
  dp_t b{{"cpu"}, small_cfg(), opts(8, true)};
  EXPECT_THROW(b.load(path), troupe::invalid_argument);
}

TEST(Train, AReplicaTypeWhoseOptimizerCannotTravelIsWarnedAboutOnceAndCounted) {
  // seeded_classifier: SGD with momentum, and neither optimizer() nor save/load. Replicas that
  // join a run start with empty momentum buffers: the run is warned about once, every such join
  // is counted, and (the reason for both) the parameters no longer match one replica's.
  optimizer_warnings caught;
  auto batches = make_batches(6, 48);
  auto train = [&](bool join) {
    troupe::data_parallel<seeded_classifier> dp{troupe::cpus(1), small_cfg(), opts(8, true)};
    for (std::size_t i = 0; i < batches.size(); ++i) {
      if (join && (i == 2 || i == 4)) dp.add_devices({"cpu"});
      dp.step(batches[i]);
    }
    return std::make_pair(flat(dp.parameters()), dp.stats());
  };
  auto [alone, alone_stats] = train(false);
  EXPECT_EQ(alone_stats.fresh_state_joins, 0u);
  EXPECT_TRUE(caught.lines().empty());
  auto [joined, joined_stats] = train(true);
  EXPECT_EQ(joined_stats.fresh_state_joins, 2u);
  auto warnings = caught.lines();
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("torch::optim::Optimizer& optimizer()"), std::string::npos)
      << warnings[0];
  EXPECT_FALSE(same_bits(joined, alone)) << "fresh momentum buffers changed nothing?";
}

TEST(Train, AReplicaTypeWhoseOptimizerCannotTravelIsWarnedAboutOnceOnALiveClusterToo) {
  // The same replica type on nodes of a live cluster (the test node registers it): a node
  // added at step 2 (cluster::add) and a SIGKILLed node restarted on its address at step 4
  // (its rejoin) are two joins whose optimizer starts fresh: counted, and warned about once.
  optimizer_warnings caught;
  auto address = test_util::free_loopback_address();
  std::optional<node_process> a;
  a.emplace(TROUPE_TEST_NODE, address);
  node_process b{TROUPE_TEST_NODE, "127.0.0.1:0"};
  rejoin_watch watch{address};
  auto cl = troupe::cluster::connect({a->address()}, {}, watch.options());
  troupe::data_parallel<seeded_classifier> dp{cl, small_cfg(), opts(8, true)};
  auto batches = make_batches(6, 48);
  for (std::size_t i = 0; i < batches.size(); ++i) {
    if (i == 2) cl.add(b.address());
    if (i == 4) {
      restart_killed(a, address);
      watch.wait();
    }
    dp.step(batches[i]);
  }
  EXPECT_EQ(dp.devices().size(), 2u);
  EXPECT_EQ(dp.stats().fresh_state_joins, 2u) << "the add and the rejoin";
  auto warnings = caught.lines();
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("torch::optim::Optimizer& optimizer()"), std::string::npos)
      << warnings[0];
}

TEST(Train, AddedReplicasTakeTheCurrentStateAndRemovedOnesAreNotMissed) {
  auto batches = make_batches(15, 40);
  dp_t dp{{"cpu"}, small_cfg(), opts(8, true)};
  for (int i = 0; i < 5; ++i) dp.step(batches[i]);
  dp.add_devices({"cpu", "cpu"});
  EXPECT_EQ(dp.devices().size(), 3u);
  expect_replicas_identical(dp);
  for (int i = 5; i < 10; ++i) {
    dp.step(batches[i]);
    expect_replicas_identical(dp);
  }
  dp.remove_devices({"cpu"});
  EXPECT_EQ(dp.devices().size(), 2u);
  for (int i = 10; i < 15; ++i) dp.step(batches[i]);
  expect_replicas_identical(dp);
  // Parameters and momentum moved with the replicas: the one-device run, bit for bit.
  EXPECT_TRUE(same_bits(flat(dp.parameters()), trained({"cpu"}, batches, opts(8, true))));
  EXPECT_THROW(dp.remove_devices({"cuda:7"}), troupe::invalid_argument);
}

TEST(Train, ANodeSigkilledInTheMiddleOfAStepCostsNothing) {
  auto batches = make_batches(12, 64);
  auto expected = trained({"cpu"}, batches, opts(8, true));
  node_process node;
  auto cfg = small_cfg();
  cfg.set("fault.exit_at_shard", 6);  // the node's replica raises SIGKILL at its 6th shard
  dp_t dp{{"cpu", node.device()}, cfg, opts(8, true)};
  for (auto& b : batches) dp.step(b);
  int signal = 0;
  ASSERT_TRUE(node.ended(&signal));
  EXPECT_EQ(signal, SIGKILL);
  auto s = dp.stats();
  EXPECT_EQ(s.lost_replicas, 1u);
  EXPECT_GT(s.recomputed_shards, 0u);  // it died holding shards: the survivor took them
  EXPECT_EQ(s.steps, batches.size());
  EXPECT_EQ(dp.devices().size(), 1u);
  EXPECT_TRUE(same_bits(flat(dp.parameters()), expected));
}

TEST(Train, AFrozenNodeIsGivenUpOnAndTrainingGoesOnWithTheSameResult) {
  auto batches = make_batches(6, 64);
  auto cfg = small_cfg();
  cfg.set("fault.sleep_ms", 20);  // 8 shards of 20 ms per step: the freeze lands in a step
  auto expected = trained({"cpu"}, batches, opts(8, true));
  node_process node;
  dp_t dp{{"cpu", node.device()}, cfg, opts(8, true)};
  dp.step(batches[0]);
  auto freezer = signal_after(node, SIGSTOP, 30);
  for (std::size_t i = 1; i < batches.size(); ++i) dp.step(batches[i]);
  freezer.join();
  EXPECT_EQ(dp.stats().lost_replicas, 1u);
  EXPECT_TRUE(same_bits(flat(dp.parameters()), expected));
}

TEST(Train, BadArgumentsAndFailingReplicasAreClearErrors) {
  EXPECT_THROW(dp_t({}, small_cfg()), troupe::invalid_argument);
  EXPECT_THROW(dp_t({"cpu"}, small_cfg(), opts(0, false)), troupe::invalid_argument);
  dp_t dp{{"cpu"}, small_cfg()};
  EXPECT_THROW(dp.step({}), troupe::invalid_argument);
  auto broken = small_cfg();
  broken.set("model.hidden", -5);  // torch::nn::Linear throws in the replica's constructor
  try {
    dp_t bad{{"cpu", "cpu"}, broken};
    FAIL() << "constructed";
  } catch (const troupe::init_error& e) {
    EXPECT_NE(std::string{e.what()}.find("cpu"), std::string::npos) << e.what();
  }
  EXPECT_THROW(dp_t({"cuda:7"}, small_cfg()), troupe::device_unavailable);
}
