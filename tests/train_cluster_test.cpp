// troupe::data_parallel on GPUs and on a live cluster (the optimizer's state follows joins,
// restarts and drains), a fuzzed training session, and the training simulation's bits against
// the real runs.
#include "train_parts.hpp"

TEST(Train, ReplicasOnGpusStayIdenticalAndMatchTheCpuLoop) {
  auto gpus = troupe::gpus();
  if (gpus.empty()) GTEST_SKIP() << "no GPU here: " << troupe::why_unavailable("cuda:0");
  if (gpus.size() == 1) gpus.push_back(gpus[0]);  // two replicas on one GPU
  auto batches = make_batches(10, 48);
  for (bool deterministic : {false, true}) {
    dp_t dp{gpus, small_cfg(), opts(8, deterministic)};
    for (auto& b : batches) {
      dp.step(b);
      expect_replicas_identical(dp);
    }
    // GPU kernels sum in another order than the CPU's: close, not equal.
    EXPECT_LT(relative_difference(flat(dp.parameters()), plain_result(batches, 16)), 1e-4);
  }
}

TEST(Train, DataParallelFollowsItsClusterAndTheParametersStayBitIdentical) {
  // 2 replicas on nodes and one local, deterministic; a third node joins at step 5, one node is
  // SIGKILLed and restarted on its address at step 10, one is drained at step 15: after 20
  // steps the parameters are bit-identical to a run on one local replica.
  auto batches = make_batches(20, 64);
  auto expected = trained({"cpu"}, batches, opts(8, true));
  auto address = test_util::free_loopback_address();
  std::optional<node_process> a;
  a.emplace(address);
  node_process b, c;
  std::mutex mtx;
  std::condition_variable cv;
  std::vector<troupe::membership_event> events;
  troupe::cluster_options co;
  co.on_change = [&](const troupe::membership_event& e) {
    std::lock_guard<std::mutex> guard{mtx};
    events.push_back(e);
    cv.notify_all();
  };
  auto cl = troupe::cluster::connect({a->address(), b.address()}, {}, co);
  dp_t dp{cl, small_cfg(), opts(8, true)};
  EXPECT_EQ(dp.devices().size(), 2u);
  dp.add_devices({"cpu"});
  for (std::size_t i = 0; i < batches.size(); ++i) {
    if (i == 5) {
      cl.add(c.address());  // returns once the replica there has the current state
      EXPECT_EQ(dp.devices().size(), 4u);
    }
    if (i == 10) {
      restart_killed(a, address);
      test_util::watchdog dog{std::chrono::seconds{60}, "the restarted node's rejoin"};
      std::unique_lock<std::mutex> lock{mtx};
      cv.wait(lock, [&] {
        return std::any_of(events.begin(), events.end(), [&](const troupe::membership_event& e) {
          return e.what == troupe::membership_event::rejoined && e.node == address;
        });
      });
    }
    if (i == 15) cl.remove(b.address());  // between steps: its replica leaves
    dp.step(batches[i]);
    expect_replicas_identical(dp);
  }
  auto ds = dp.devices();
  EXPECT_EQ(ds.size(), 3u);  // a (restarted), c, and the local one
  EXPECT_EQ(std::count(ds.begin(), ds.end(), troupe::device{b.address() + "/cpu"}), 0);
  EXPECT_EQ(std::count(ds.begin(), ds.end(), troupe::device{address + "/cpu"}), 1);
  EXPECT_TRUE(same_bits(flat(dp.parameters()), expected));
}

TEST(Train, DataParallelOnAClusterStartsWithoutAMemberThatLeftAfterTheSnapshot) {
  // As a runner does: a node killed after the cluster last heard from it (a probe every 30 s
  // here) is in the starting list, and its replica cannot start. data_parallel starts on the
  // others instead of failing, and trains.
  node_process a, b;
  troupe::cluster_options co;
  co.heartbeat = std::chrono::seconds{30};
  co.lost_after = std::chrono::seconds{120};
  auto cl = troupe::cluster::connect({a.address(), b.address()}, {}, co);
  ASSERT_EQ(cl.devices().size(), 2u);
  a.kill(SIGKILL);
  {
    test_util::watchdog dog{std::chrono::seconds{60}, "the killed node's exit"};
    while (!a.ended()) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  }
  ASSERT_EQ(cl.devices().size(), 2u) << "the cluster noticed the kill: nothing left to test";
  auto batches = make_batches(3, 48);
  dp_t dp{cl, small_cfg(), opts(8, true)};
  EXPECT_EQ(dp.devices(), (std::vector<troupe::device>{troupe::device{b.device()}}));
  for (auto& batch : batches) dp.step(batch);
  EXPECT_TRUE(same_bits(flat(dp.parameters()), trained({"cpu"}, batches, opts(8, true))));
}

/// A PyTorch user's run on a live cluster (docs/api.md, "The optimizer's state follows the
/// replicas"): replicas that seed torch's global generator in their constructor, with SGD +
/// momentum, Adam or AdamW reached through optimizer() (no save/load). A node joins at step 5,
/// one is SIGKILLed and restarted on its address at step 10 (not waiting for its rejoin, which
/// lands between two later steps), one is drained at step 15: after 20 steps the parameters are
/// bit-identical to one local replica's. Repeat with --gtest_repeat=5 for the acceptance's 5 runs.
class TrainOptimizerState : public testing::TestWithParam<const char*> {};

TEST_P(TrainOptimizerState, FollowsJoinsRestartsAndDrainsBitForBit) {
  auto cfg = small_cfg();
  cfg.set("optim", std::string{GetParam()}).set("model.init", std::string{"torch"});
  if (std::string{GetParam()} != "sgd") cfg.set("sgd.lr", 0.01);
  auto batches = make_batches(20, 64);
  auto expected = trained({"cpu"}, batches, opts(8, true), cfg);
  auto address = test_util::free_loopback_address();
  std::optional<node_process> a;
  a.emplace(address);
  node_process b, c;
  rejoin_watch watch{address};
  auto cl = troupe::cluster::connect({a->address(), b.address()}, {}, watch.options());
  dp_t dp{cl, cfg, opts(8, true)};
  ASSERT_EQ(dp.devices().size(), 2u);
  for (std::size_t i = 0; i < batches.size(); ++i) {
    if (i == 5) {
      cl.add(c.address());  // returns once the replica there has the current state
      EXPECT_EQ(dp.devices().size(), 3u);
    }
    if (i == 10) {
      restart_killed(a, address);  // its rejoin comes while the next steps run
    }
    if (i == 15) {
      // The rejoin must have been taken by now, between two steps (else this run would not
      // have tested it): wait for it here if it has not come yet.
      watch.wait();
      cl.remove(b.address());  // between steps: its replica leaves
    }
    dp.step(batches[i]);
    expect_replicas_identical(dp);
  }
  auto ds = dp.devices();
  EXPECT_EQ(ds.size(), 2u);  // a (restarted) and c
  EXPECT_EQ(std::count(ds.begin(), ds.end(), troupe::device{address + "/cpu"}), 1);
  EXPECT_EQ(dp.stats().fresh_state_joins, 0u);
  EXPECT_TRUE(same_bits(flat(dp.parameters()), expected))
      << "the parameters differ from one local replica's";
}

INSTANTIATE_TEST_SUITE_P(Train, TrainOptimizerState, testing::Values("sgd", "adam", "adamw"),
                         [](const testing::TestParamInfo<const char*>& i) {
                           return std::string{i.param};
                         });

// Captures a real coordinator's training session with a node (its replica's init, backward and
// apply commands, the samples, the gradients it is sent), then replays mutated versions of it
// against another node: the node must survive every one (no crash, no unbounded memory) and
// still train exactly afterwards. TROUPE_FUZZ_SESSIONS sets how many (default 100),
// TROUPE_FUZZ_SEED the mutations.
TEST(TrainHostile, FuzzedReplaysOfARealTrainingSessionLeaveTheNodeTraining) {
  using namespace wire_attack;  // NOLINT: the attacks' tools
  auto batches = make_batches(3, 32);
  std::string captured;
  {
    node_process capture_node;
    recording_relay relay{capture_node.port()};
    dp_t dp{{"cpu", troupe::device{"127.0.0.1:" + std::to_string(relay.port()) + "/cpu"}},
            small_cfg(),
            opts(8, true)};
    for (auto& b : batches) dp.step(b);
    expect_replicas_identical(dp);
    captured = relay.client_bytes();
  }
  // Replays must not claim this process's node id: it is rewritten (wire_attack.hpp).
  auto session = replayable_frames(captured, troupe::detail::network_system({}), 0x5b);
  ASSERT_GT(session.size(), 10u) << captured.size() << " bytes captured";
  std::size_t sessions = 100;
  if (auto* n = std::getenv("TROUPE_FUZZ_SESSIONS")) sessions = std::stoul(n);
  std::uint64_t seed = 20261126;
  if (auto* x = std::getenv("TROUPE_FUZZ_SEED")) seed = std::stoull(x);
  std::mt19937_64 rng{seed};
  node_process target;
  std::this_thread::sleep_for(std::chrono::milliseconds{200});
  auto rss_before = proc_status(target.pid(), "VmRSS");
  long rss_peak = rss_before;
  for (std::size_t i = 0; i < sessions; ++i) {
    auto bytes = i == 0 ? captured : mutate(session, rng);  // the first one as it was
    int fd = raw_connect(target.port());
    send_all(fd, bytes);
    closed_by_peer_within(fd, std::chrono::milliseconds{50});
    close(fd);
    ASSERT_TRUE(target.alive()) << "node died in session " << i << " (seed " << seed << ")";
    rss_peak = std::max(rss_peak, proc_status(target.pid(), "VmRSS"));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds{300});
  ASSERT_TRUE(target.alive());
  EXPECT_LT(rss_peak - rss_before, 512 * 1024) << "kB, before " << rss_before;
  std::printf(
      "fuzz: seed %llu, %zu training sessions of %zu messages (%zu bytes), node RSS %ld "
      "-> peak %ld kB\n",
      static_cast<unsigned long long>(seed), sessions, session.size(), captured.size(), rss_before,
      rss_peak);
  // And it still trains: the same parameters as one local replica.
  dp_t dp{{"cpu", target.device()}, small_cfg(), opts(8, true)};
  for (auto& b : batches) dp.step(b);
  EXPECT_TRUE(same_bits(flat(dp.parameters()), trained({"cpu"}, batches, opts(8, true))));
}

TEST(SimulatedTraining, LocalStepsAveragingAndAStepAfterThemEqualDataParallelBitForBit) {
  // Local SGD as its users write it: local steps, an average every 2, then a synchronous step
  // (which starts from replica 0's state). The simulation drives the coordinator core that
  // data_parallel runs, so the parameters and the mean losses are the same bits.
  auto batches = make_batches(7, 64);
  auto cfg = small_cfg();
  cfg.set("optim", std::string{"adam"});
  dp_t real{{"cpu", "cpu"}, cfg, opts(16, true)};
  troupe::testing::simulation sim{3};
  sim.nodes({"a:1", "b:1"}, troupe::cpus(1));
  auto simulated = sim.data_parallel<example::classifier>(sim.devices(), cfg, opts(16, true));
  for (std::size_t i = 0; i < batches.size(); ++i) {
    double a = 0, b = 0;
    if (i + 1 == batches.size()) {
      a = real.step(batches[i]);
      b = simulated.step(batches[i]);
    } else {
      a = real.local_step(batches[i]);
      b = simulated.local_step(batches[i]);
    }
    EXPECT_EQ(a, b) << "step " << i;
    if (i % 2 == 1) {
      real.average_parameters();
      simulated.average_parameters();
    }
  }
  EXPECT_TRUE(same_bits(flat(real.parameters()), flat(simulated.parameters())));
  auto reps = simulated.replica_parameters();
  ASSERT_EQ(reps.size(), 2u);
  EXPECT_TRUE(same_bits(reps[0], reps[1]));
  EXPECT_NE(simulated.trace().find("local step 1: 64 samples"), std::string::npos);
  // A replica killed during a local step takes its update and its samples' losses with it.
  troupe::testing::simulation faulty{3};
  faulty.nodes({"a:1", "b:1"}, troupe::cpus(1));
  faulty.at_step(2).at_shard(1).kill("b:1");
  auto dp = faulty.data_parallel<example::classifier>(faulty.devices(), cfg, opts(16, true));
  dp.local_step(batches[0]);
  dp.local_step(batches[1]);
  EXPECT_EQ(dp.devices().size(), 1u);
  EXPECT_EQ(dp.stats().lost_replicas, 1u);
  EXPECT_EQ(dp.stats().recomputed_shards, 0u) << dp.trace();  // a local step recomputes nothing
}

/// The node processes of these tests (examples/train) run one LibTorch intra-op thread; a
/// matrix product splits its sums by the thread count, so the same bits here (the simulation
/// runs its replicas on this thread) need one thread too, for the test's length.
struct one_intra_op_thread {
  int before = at::get_num_threads();
  one_intra_op_thread() { at::set_num_threads(1); }
  ~one_intra_op_thread() { at::set_num_threads(before); }
  one_intra_op_thread(const one_intra_op_thread&) = delete;
  one_intra_op_thread& operator=(const one_intra_op_thread&) = delete;
};

TEST(SimulatedTraining, ARingOfThreeNodesGivesTheRealRingsBits) {
  // A 4.2 MiB gradient, fast mode, replicas on nodes: each step is all-reduced in a ring, whose
  // chunks are summed in ring order from a different member each (not the coordinator's order).
  // One shard per replica (a split that no measured speed changes): the simulated ring, run
  // with the real ring's schedule, gives the bits of three node processes' ring.
  one_intra_op_thread threads;
  auto batches = make_batches(3, 48);
  auto cfg = ring_cfg();
  node_process a, b, c;
  dp_t real{{a.device(), b.device(), c.device()}, cfg, opts(16, false)};
  troupe::testing::simulation sim{1};
  sim.nodes({"a:1", "b:1", "c:1"}, troupe::cpus(1));
  auto simulated = sim.data_parallel<example::classifier>(sim.devices(), cfg, opts(16, false));
  for (auto& batch : batches) EXPECT_EQ(real.step(batch), simulated.step(batch));
  EXPECT_EQ(real.stats().ring_reductions, 3u);
  EXPECT_EQ(simulated.stats().ring_reductions, 3u) << simulated.trace();
  EXPECT_TRUE(same_bits(flat(real.parameters()), flat(simulated.parameters())));
  // Not the coordinator's sum: the same steps through the coordinator differ in their last bits.
  dp_t summed{{"cpu", "cpu", "cpu"}, cfg, opts(16, false)};
  for (auto& batch : batches) summed.step(batch);
  EXPECT_EQ(summed.stats().ring_reductions, 0u);
  EXPECT_FALSE(same_bits(flat(summed.parameters()), flat(real.parameters())));
}

TEST(SimulatedTraining, ARingMemberKilledMidRingEqualsTheRealRun) {
  // Three nodes, rings; node c dies in the ring of step 3: the step is computed again by the
  // survivors, and the run goes on with them. In the real run c's process SIGKILLs itself as
  // its replica starts its third ring (TROUPE_TEST_DIE_AT_RING), so the loss lands in that ring
  // every run. Three members: a wrong order of the sums shows in the bits. Each replica computes
  // one shard or none (3 shards a step, then 2 from step 3 on): a split that no measured speed
  // changes (3 shards over the 2 survivors would be summed (x0 + x1) + x2 or x0 + (x1 + x2),
  // whichever the speeds measured in that run say: fast mode's sum is not fixed).
  one_intra_op_thread threads;
  auto batches = make_batches(2, 48);
  for (auto& b : make_batches(4, 32, 12)) batches.push_back(b);
  auto cfg = ring_cfg();
  troupe::testing::simulation sim{2};
  sim.nodes({"a:1", "b:1", "c:1"}, troupe::cpus(1));
  sim.at_step(3).in_ring().kill("c:1");
  auto simulated = sim.data_parallel<example::classifier>(sim.devices(), cfg, opts(16, false));
  for (auto& batch : batches) simulated.step(batch);
  auto trace = simulated.trace();
  EXPECT_NE(trace.find("lose c:1/cpu: killed in the ring all-reduce"), std::string::npos) << trace;
  EXPECT_EQ(simulated.stats().lost_replicas, 1u);
  EXPECT_EQ(simulated.devices().size(), 2u);
  node_process a, b;
  ::setenv("TROUPE_TEST_DIE_AT_RING", "3", 1);
  node_process c;  // inherits it
  ::unsetenv("TROUPE_TEST_DIE_AT_RING");
  dp_t real{{a.device(), b.device(), c.device()}, cfg, opts(16, false)};
  for (std::size_t i = 0; i < batches.size(); ++i) {
    real.step(batches[i]);
    EXPECT_EQ(real.stats().lost_replicas, i < 2 ? 0u : 1u) << "after step " << i + 1;
  }
  EXPECT_EQ(real.stats().ring_reductions, simulated.stats().ring_reductions);
  // Step 3's 2 shards are computed again. When a survivor's broken ring reaches the coordinator
  // before c's loss does (the order of two messages from two processes), c is still alive for
  // that recomputation and may get one of them, computed a third time once its loss arrives.
  auto again = real.stats().recomputed_shards,
       simulated_again = simulated.stats().recomputed_shards;
  EXPECT_EQ(simulated_again, 2u);
  EXPECT_TRUE(again == simulated_again || again == simulated_again + 1) << again;
  EXPECT_TRUE(same_bits(flat(real.parameters()), flat(simulated.parameters())));
}

TEST(SimulatedTraining, FaultsPastANodesShardsHappenAfterTheStepAndShortFreezesOnlyDelay) {
  auto batches = make_batches(4, 32);  // 4 shards of 8 a step
  auto run = [&](auto&& script) {
    troupe::testing::simulation sim{5};
    sim.nodes({"a:1", "b:1"}, troupe::cpus(1));
    script(sim);
    auto o = opts(8, true);
    o.replica_timeout = std::chrono::seconds{1};
    auto dp = sim.data_parallel<example::classifier>(sim.devices(), small_cfg(), o);
    for (auto& b : batches) dp.step(b);
    return std::make_tuple(flat(dp.parameters()), dp.trace(), dp.stats(), dp.now());
  };
  auto [clean, clean_trace, clean_stats, clean_time] = run([](auto&) {});
  // a:1 never computes 100 shards in step 1: it dies right after that step.
  auto [p1, t1, s1, n1] = run([](auto& sim) { sim.at_step(1).at_shard(100).kill("a:1"); });
  EXPECT_NE(t1.find("lose a:1/cpu: killed after step 1"), std::string::npos) << t1;
  EXPECT_NE(t1.find("step 2: 32 samples, 4 shards, 1 replicas"), std::string::npos) << t1;
  EXPECT_EQ(s1.lost_replicas, 1u);
  EXPECT_TRUE(same_bits(p1, clean));
  // A 200 ms freeze (below replica_timeout and the heartbeats' limit) delays, loses nothing.
  auto [p2, t2, s2, n2] =
      run([](auto& sim) { sim.at_step(2).freeze("b:1", std::chrono::milliseconds{200}); });
  EXPECT_EQ(s2.lost_replicas, 0u) << t2;
  EXPECT_GE(n2 - clean_time, std::chrono::milliseconds{200});
  EXPECT_TRUE(same_bits(p2, clean));
  // A node slowed 10 times gets fewer shards from then on (the planner follows measured speed).
  auto [p3, t3, s3, n3] = run([](auto& sim) { sim.at_step(1).slow("b:1", 10.0); });
  ASSERT_EQ(s3.replicas.size(), 2u);
  EXPECT_GT(s3.replicas[0].shards, s3.replicas[1].shards) << t3;
  EXPECT_TRUE(same_bits(p3, clean));
  // A freeze past the heartbeats' limit after the last shard: lost before the next step.
  auto [p4, t4, s4, n4] =
      run([](auto& sim) { sim.at_step(3).at_shard(50).freeze("a:1", std::chrono::seconds{10}); });
  EXPECT_NE(t4.find("lose a:1/cpu: silent for limits::idle_timeout (frozen after step 3)"),
            std::string::npos)
      << t4;
  EXPECT_TRUE(same_bits(p4, clean));
  // Scripts name nodes of the simulation, count from 1.
  troupe::testing::simulation sim{1};
  sim.nodes({"a:1"}, troupe::cpus(1));
  EXPECT_THROW(sim.at_step(0), troupe::invalid_argument);
  EXPECT_THROW(sim.at_step(1).at_shard(0), troupe::invalid_argument);
  EXPECT_THROW(sim.at_step(1).kill("z:1"), troupe::invalid_argument);
  EXPECT_THROW(sim.data_parallel<example::classifier>({"cpu"}, small_cfg()),
               troupe::invalid_argument);
}
