// troupe::data_parallel when replicas fail: teardown and failed starts, a throwing step, save
// or load, grads reset to none, a node that comes back, a replica stuck past replica_timeout.
#include "train_parts.hpp"

namespace {

/// A replica whose backward calls the optimizer's zero_grad() itself (LibTorch's default sets
/// the grads to none, so autograd makes new tensors for them).
struct zeroing_job {
  struct replica {
    replica(const troupe::device&, const troupe::config&) { example::init_parameters(net, 3); }
    std::vector<torch::Tensor> parameters() { return net.parameters(); }
    double backward(const std::vector<sample>& shard) {
      opt.zero_grad();
      auto [x, y] = example::stack(shard, 8);
      auto loss = torch::nn::functional::cross_entropy(
          net.forward(x), y,
          torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
      loss.backward();
      return loss.item<double>();
    }
    void step() { opt.step(); }
    example::mlp_net net{8, 16, 3};
    torch::optim::SGD opt{net.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)};
  };
};

}  // namespace

namespace {

/// A replica whose destructor takes 200 ms and then counts itself.
std::atomic<int> slow_teardowns_done{0};
struct slow_teardown_job {
  struct replica : zeroing_job::replica {
    replica(const troupe::device& d, const troupe::config& cfg) : zeroing_job::replica(d, cfg) {}
    replica(const replica&) = delete;
    replica& operator=(const replica&) = delete;
    ~replica() {
      std::this_thread::sleep_for(std::chrono::milliseconds{200});
      slow_teardowns_done += 1;
    }
  };
};

}  // namespace

TEST(Train, LocalReplicasAreDestroyedBeforeTheDestructorReturns) {
  // A program may end right after its data_parallel: a replica freeing its (GPU) tensors on its
  // own thread after that raced LibTorch's CUDA teardown at exit (a segfault on the GPU machine).
  // A removed replica is destroyed before remove_devices() returns.
  slow_teardowns_done = 0;
  {
    troupe::data_parallel<slow_teardown_job> dp{{"cpu", "cpu", "cpu"}, {}, opts(8, false)};
    dp.step(make_batches(1, 32)[0]);
    dp.remove_devices({"cpu"});
    EXPECT_EQ(slow_teardowns_done.load(), 1);
    dp.step(make_batches(1, 32)[0]);
  }
  EXPECT_EQ(slow_teardowns_done.load(), 3);
}

namespace {

/// The third replica constructed throws; the others take 200 ms to be destroyed.
std::atomic<int> started_replicas{0};
struct failing_start_job {
  struct replica : slow_teardown_job::replica {
    replica(const troupe::device& d, const troupe::config& cfg)
        : slow_teardown_job::replica(d, cfg) {
      if (started_replicas.fetch_add(1) == 2) throw std::runtime_error("no room on this device");
    }
  };
};

}  // namespace

TEST(Train, ReplicasThatStartedAreDestroyedBeforeAFailedStartThrows) {
  // A program may end on that exception: the replicas that did start must not be freeing their
  // (GPU) tensors on their threads by then. (The one that threw counts itself too, in its base.)
  slow_teardowns_done = 0;
  started_replicas = 0;
  EXPECT_THROW(
      (troupe::data_parallel<failing_start_job>{{"cpu", "cpu", "cpu"}, {}, opts(8, false)}),
      troupe::init_error);
  EXPECT_EQ(slow_teardowns_done.load(), 3);
  slow_teardowns_done = 0;
  started_replicas = 0;  // the second added replica fails (constructed one at a time, in order)
  {
    troupe::data_parallel<failing_start_job> dp{{"cpu"}, {}, opts(8, false)};
    EXPECT_THROW(dp.add_devices({"cpu", "cpu"}), troupe::init_error);
    EXPECT_EQ(slow_teardowns_done.load(), 2);
  }
  EXPECT_EQ(slow_teardowns_done.load(), 3);
}

TEST(Train, ANodeLostBetweenStepsIsNotHiddenByARemoval) {
  // remove_devices() waits for the removed replica's answer; the down message of a node lost
  // before it, waiting in the same mailbox, was taken and thrown away there: the next step then
  // waited for the dead node forever.
  auto batches = make_batches(2, 48);
  node_process a;
  dp_t dp{{"cpu", "cpu", a.device()}, small_cfg(), opts(8, false)};
  dp.step(batches[0]);
  a.kill(SIGKILL);
  while (!a.ended()) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  std::this_thread::sleep_for(std::chrono::milliseconds{500});  // its connection closes here
  test_util::watchdog guard{std::chrono::seconds{60}, "the step after remove_devices"};
  dp.remove_devices({"cpu"});
  dp.step(batches[1]);
  EXPECT_EQ(dp.stats().lost_replicas, 1u);
  EXPECT_EQ(dp.devices().size(), 1u);
  EXPECT_LT(relative_difference(flat(dp.parameters()), plain_result(batches, 16)), 1e-5);
}

namespace {

/// The next save() or load() (whichever replica runs it first) throws once.
std::atomic<bool> fail_next_save{false}, fail_next_load{false};
struct fragile_state_job {
  struct replica : example::classifier::replica {
    using example::classifier::replica::replica;
    void save(torch::serialize::OutputArchive& a) {
      if (fail_next_save.exchange(false)) throw std::runtime_error("disk full");
      a.write("steps", torch::ones({1}));  // something of its own beside the optimizer's state
    }
    void load(torch::serialize::InputArchive& a) {
      if (fail_next_load.exchange(false)) throw std::runtime_error("bad optimizer state");
      torch::Tensor steps;
      a.read("steps", steps);
    }
  };
};

}  // namespace

namespace {

/// The next step() (whichever replica runs it first) throws once.
std::atomic<bool> fail_next_step{false};
struct fragile_step_job {
  struct replica : example::classifier::replica {
    using example::classifier::replica::replica;
    void step() {
      if (fail_next_step.exchange(false)) throw std::runtime_error("optimizer blew up");
      example::classifier::replica::step();
    }
  };
};

}  // namespace

TEST(Train, AReplicaWhoseStepThrowsIsDroppedAndTheOthersStayIdentical) {
  // Its optimizer did not step while the others' did: it no longer matches them. The step
  // throws work_error saying so, the replica is gone, and the others train on, identical. The
  // simulation does the same (it used to stop at the throw, leaving the later replicas behind).
  auto batches = make_batches(3, 48);
  auto check = [&](auto& dp, const char* what) {
    SCOPED_TRACE(what);
    dp.step(batches[0]);
    fail_next_step = true;
    try {
      dp.step(batches[1]);
      ADD_FAILURE() << "no work_error";
    } catch (const troupe::work_error& e) {
      std::string m = e.what();
      EXPECT_EQ(m.rfind("replica::step() threw on ", 0), 0u) << m;
      EXPECT_NE(m.find("that replica is dropped; the others have stepped"), std::string::npos) << m;
      EXPECT_NE(m.find("optimizer blew up"), std::string::npos) << m;
    }
    EXPECT_EQ(dp.devices().size(), 2u);
    EXPECT_EQ(dp.stats().lost_replicas, 1u);
    dp.step(batches[2]);
    expect_replicas_identical(dp);
  };
  troupe::data_parallel<fragile_step_job> real{{"cpu", "cpu", "cpu"}, small_cfg(), opts(8, true)};
  check(real, "data_parallel");
  troupe::testing::simulation sim{3};
  sim.nodes({"a:1", "b:1", "c:1"}, troupe::cpus(1));
  auto simulated = sim.data_parallel<fragile_step_job>(sim.devices(), small_cfg(), opts(8, true));
  check(simulated, "simulated");
  // Both kept the same two replicas' worth of training: the same parameters.
  EXPECT_TRUE(same_bits(flat(real.parameters()), flat(simulated.parameters())));
}

TEST(Train, AFailedLoadOrStateCopyLeavesNoReplicaDifferent) {
  // A replica whose load() threw holds the new parameters and its old optimizer state: it is
  // dropped. A replica added whose state could not be copied is not kept either.
  auto batches = make_batches(3, 48);
  auto path = ::testing::TempDir() + "troupe_fragile_state.pt";
  troupe::data_parallel<fragile_state_job> dp{{"cpu", "cpu", "cpu"}, small_cfg(), opts(8, false)};
  dp.step(batches[0]);
  dp.save(path);
  dp.step(batches[1]);
  // work_error names the call that failed.
  auto expect_work_error = [](auto&& call, const std::string& starts_with) {
    try {
      call();
      ADD_FAILURE() << "no work_error";
    } catch (const troupe::work_error& e) {
      EXPECT_EQ(std::string{e.what()}.rfind(starts_with, 0), 0u) << e.what();
    }
  };
  fail_next_load = true;
  expect_work_error([&] { dp.load(path); }, "loading the state: ");
  EXPECT_EQ(dp.devices().size(), 2u);
  dp.step(batches[2]);
  expect_replicas_identical(dp);
  fail_next_save = true;
  expect_work_error([&] { dp.add_devices({"cpu"}); }, "saving the state: ");
  EXPECT_EQ(dp.devices().size(), 2u);
  dp.step(batches[2]);
  expect_replicas_identical(dp);
  std::remove(path.c_str());
}

TEST(Train, AStepAfterLocalStepsStartsFromOneStateOnEveryReplica) {
  // local_step() lets each optimizer step on its own gradients (momentum differs); the next
  // step() must still leave every replica bit-identical, averaged first or not.
  auto batches = make_batches(6, 48);
  dp_t dp{{"cpu", "cpu", "cpu"}, small_cfg(), opts(8, false)};
  dp.local_step(batches[0]);
  dp.local_step(batches[1]);
  dp.average_parameters();
  dp.step(batches[2]);
  expect_replicas_identical(dp);
  dp.step(batches[3]);
  expect_replicas_identical(dp);
  dp.local_step(batches[4]);
  dp.step(batches[5]);
  expect_replicas_identical(dp);
}

TEST(Train, ALocalStepsMeanLossLeavesOutExactlyTheLostSamples) {
  // 60 samples in shards of 8: the node's half holds the short last shard (4 samples), and it
  // dies at its first shard. The mean loss is over the local replica's 32 samples.
  auto batch = make_batches(1, 60)[0];
  std::vector<sample> first(batch.begin(), batch.begin() + 32);
  dp_t alone{{"cpu"}, small_cfg(), opts(8, false)};
  auto expected = alone.local_step(first);
  auto cfg = small_cfg();
  cfg.set("fault.exit_at_shard", 1);
  node_process a;
  dp_t dp{{"cpu", a.device()}, cfg, opts(8, false)};
  auto got = dp.local_step(batch);
  EXPECT_EQ(dp.stats().lost_replicas, 1u);
  EXPECT_NEAR(got, expected, 1e-6 * std::abs(expected));
}

TEST(Train, ABackwardThatResetsItsGradsToNoneStillCounts) {
  auto batches = make_batches(20, 48);
  troupe::data_parallel<zeroing_job> dp{{"cpu", "cpu"}, {}, opts(8, false)};
  for (auto& b : batches) dp.step(b);
  expect_replicas_identical(dp);
  EXPECT_LT(relative_difference(flat(dp.parameters()), plain_result(batches, 16)), 1e-5);
}

TEST(Train, ANodeThatComesBackIsAddedAgainAndTheResultIsTheSame) {
  auto batches = make_batches(12, 64);
  auto expected = trained({"cpu"}, batches, opts(8, true));
  node_process first;
  dp_t dp{{"cpu", first.device()}, small_cfg(), opts(8, true)};
  for (int i = 0; i < 5; ++i) dp.step(batches[i]);
  first.kill(SIGKILL);
  dp.step(batches[5]);  // finds it gone: the local replica computes everything
  ASSERT_EQ(dp.devices().size(), 1u);
  node_process second;  // the node comes back (a fresh process)
  dp.add_devices({second.device()});
  EXPECT_EQ(dp.devices().size(), 2u);
  expect_replicas_identical(dp);
  for (int i = 6; i < 12; ++i) dp.step(batches[i]);
  expect_replicas_identical(dp);
  auto s = dp.stats();
  EXPECT_EQ(s.lost_replicas, 1u);
  ASSERT_EQ(s.replicas.size(), 3u);
  EXPECT_GT(s.replicas[2].shards, 0u);  // the new replica took part
  EXPECT_TRUE(same_bits(flat(dp.parameters()), expected));
}

namespace {

/// The first replica constructed (per test) sleeps for four seconds in its second backward.
std::atomic<int> stuck_replicas{0};
std::atomic<bool> stuck_finished{false};  ///< the stuck backward has returned
struct stuck_job {
  struct replica {
    replica(const troupe::device& d, const troupe::config& cfg)
        : inner(d, cfg), stuck(stuck_replicas.fetch_add(1) == 0) {}
    std::vector<torch::Tensor> parameters() { return inner.parameters(); }
    double backward(const std::vector<sample>& shard) {
      if (stuck && ++calls == 2) {
        std::this_thread::sleep_for(std::chrono::seconds{4});
        stuck_finished = true;
      }
      return inner.backward(shard);
    }
    void step() { inner.step(); }
    torch::optim::Optimizer& optimizer() { return inner.optimizer(); }
    example::classifier::replica inner;
    bool stuck;
    int calls = 0;
  };
};

}  // namespace

TEST(Train, AReplicaStuckPastReplicaTimeoutIsDroppedAndItsShardsRecomputed) {
  auto batches = make_batches(4, 64);
  auto expected = trained({"cpu"}, batches, opts(8, true));
  stuck_replicas = 0;
  stuck_finished = false;
  auto o = opts(8, true);
  // 1 s against a 4 s stall: the healthy replica, recomputing, is not mistaken for stuck on a
  // loaded machine.
  o.replica_timeout = std::chrono::milliseconds{1000};
  {
    troupe::data_parallel<stuck_job> dp{{"cpu", "cpu"}, small_cfg(), o};
    for (auto& b : batches) dp.step(b);
    EXPECT_EQ(dp.stats().lost_replicas, 1u);
    EXPECT_EQ(dp.devices().size(), 1u);
    EXPECT_TRUE(same_bits(flat(dp.parameters()), expected));
  }
  // The destructor left the stuck replica behind instead of waiting for its backward().
  EXPECT_FALSE(stuck_finished.load());
  EXPECT_THROW(troupe::data_parallel<stuck_job>({"cpu"}, small_cfg(),
                                                [] {
                                                  troupe::train_options bad;
                                                  bad.replica_timeout =
                                                      std::chrono::milliseconds{-1};
                                                  return bad;
                                                }()),
               troupe::invalid_argument);
}
