// The scheduler's core without an actor (actors/src/scheduler.hpp): events are calls, and every
// command it gives (chunks to producers, outputs to consumers, timers, exits, replacements) is
// recorded by a fake scheduler_io, so that a test reads the exact sequence and answers it in any
// order it likes, with the time it chooses.
#include "scheduler_core_parts.hpp"

namespace {

// Every scheduler in this test binary (runners, simulations, the cores below) checks its index
// of the producers with room against a scan of every producer at every pass: a change to a
// producer that forgot room_changed() fails the test that made it (std::logic_error).
struct scheduler_index_checks : ::testing::Environment {
  void SetUp() override { troupe::detail::fault_points::check_indexes = true; }
};
[[maybe_unused]] auto* const index_checks =
    ::testing::AddGlobalTestEnvironment(new scheduler_index_checks);

TEST(SchedulerCore, AJobWhoseEveryProducerWasDrainedSaysSoNotThatTheyWereLost) {
  // Every producer drained on purpose while a job still has work (every node sent SIGTERM at
  // once): the job ends with node_error, which said "every producer is lost ()" (an empty list:
  // drained slots were left out of it) and gave advice meant for local producers that failed.
  troupe::options opts;
  opts.chunk_size = 2;
  core_fixture f{{"127.0.0.1:7000/cpu", "127.0.0.1:7001/cpu"}, opts};
  auto job = f.submit(1, 100, false);
  f.core->drain({0, 1}, std::make_shared<std::promise<void>>());
  while (!f.io.chunks.empty()) {  // the chunks they hold are answered; nothing new is sent
    f.answer_oldest();
    f.consume_all();
  }
  ASSERT_EQ(f.io.ended.size(), 2u);
  for (auto p : std::vector<std::size_t>(f.io.ended)) f.core->producer_ended(p, "");
  ASSERT_TRUE(job->done());
  ASSERT_TRUE(job->error());
  try {
    std::rethrow_exception(job->error());
  } catch (const troupe::node_error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("every producer has left: each was removed or drained "
                        "(127.0.0.1:7000/cpu, 127.0.0.1:7001/cpu)"),
              std::string::npos)
        << what;
    EXPECT_EQ(what.find("lost"), std::string::npos) << what;
  }
}

TEST(SchedulerCore, AnOrderedJobAnsweredBackwardsReachesItsConsumerInOrder) {
  troupe::options opts;
  opts.chunk_size = 2;
  core_fixture f{{"cpu", "cpu"}, opts};
  auto job = f.submit(1, 8, true);
  ASSERT_EQ(f.io.chunks.size(), 4u);  // two chunks queued at each producer (min depth)
  std::vector<std::int64_t> seen;
  // Answer the last chunk first: nothing may reach the consumer before item 0.
  while (!f.io.chunks.empty()) {
    auto s = std::move(f.io.chunks.back());
    f.io.chunks.pop_back();
    f.answer(s);
    if (s.msg.first != 0) {
      EXPECT_TRUE(f.io.to_consumer.empty()) << "item " << s.msg.first;
    }
  }
  auto out = f.consume_all();
  EXPECT_EQ(out, test_util::iota(8));
  EXPECT_TRUE(job->done());
  EXPECT_EQ(job->error(), nullptr);
  EXPECT_EQ(f.io.forgotten, (std::vector<std::uint64_t>{1}));
}

TEST(SchedulerCore, ALostProducersChunksGoToTheOtherAndItsLateAnswerIsDropped) {
  troupe::options opts;
  opts.chunk_size = 3;
  opts.speculative = false;
  core_fixture f{{"h:1/cpu", "cpu"}, opts};  // producer 0 is on a node: lost, not replaced
  auto job = f.submit(7, 6, false);
  std::vector<fake_io::sent> at_node;
  for (auto& s : f.io.chunks)
    if (s.p == 0) at_node.push_back(s);
  ASSERT_FALSE(at_node.empty());
  std::size_t before = f.io.chunks.size();
  f.core->producer_down(0, "node gone", true);
  ASSERT_GT(f.io.chunks.size(), before);  // re-sent
  for (std::size_t i = before; i < f.io.chunks.size(); ++i) EXPECT_EQ(f.io.chunks[i].p, 1u);
  // The lost producer's late answer carries its old generation: dropped.
  auto late = echo(at_node.front());
  f.core->on_result(0, at_node.front().gen, late.run, at_node.front().id, late);
  for (std::size_t i = 0; i < f.io.chunks.size(); ++i) {
    auto& s = f.io.chunks[i];
    if (s.p != 1) continue;
    f.answer(s);
  }
  auto out = f.consume_all();
  std::sort(out.begin(), out.end());
  EXPECT_EQ(out, test_util::iota(6));  // each item once
  EXPECT_TRUE(job->done());
  EXPECT_EQ(job->report().redispatched, at_node.size() * 3);
  EXPECT_TRUE(f.io.replaced.empty());
}

TEST(SchedulerCore, TimersAreCommandsAndTheirEventsEndTheJob) {
  core_fixture f{{"cpu"}};
  troupe::job_options o;
  o.deadline = 50ms;
  auto job = f.submit(3, 100, false, o);
  ASSERT_FALSE(f.io.timers.empty());
  EXPECT_EQ(f.io.timers.front().first, 50ms);
  EXPECT_EQ(f.io.timers.front().second, scheduler_io::timer::deadline);
  f.io.t += 50ms;
  f.core->timer_fired(scheduler_io::timer::deadline, 3);
  ASSERT_TRUE(job->done());
  EXPECT_THROW(std::rethrow_exception(job->error()), troupe::deadline_exceeded);
  // Answers to the job's chunks, now late, are dropped; the producer takes no more of it.
  auto sent = f.io.chunks.size();
  for (auto s : std::deque<fake_io::sent>(f.io.chunks)) {
    f.answer(s);
  }
  EXPECT_EQ(f.io.chunks.size(), sent);
  EXPECT_TRUE(f.io.to_consumer.empty());
}

TEST(SchedulerCore, CloseEndsTheJobsThenTheProducersThenQuits) {
  core_fixture f{{"cpu", "cpu"}};
  auto job = f.submit(1, 1000, true);
  auto done = std::make_shared<std::promise<void>>();
  auto closed = done->get_future();
  f.core->close(done, true);
  ASSERT_TRUE(job->done());
  EXPECT_THROW(std::rethrow_exception(job->error()), troupe::runner_closed);
  EXPECT_EQ(f.io.ended, (std::vector<std::size_t>{0, 1}));
  EXPECT_FALSE(f.io.quitted);
  f.core->producer_ended(0, {});
  f.core->producer_ended(1, "end() threw");
  EXPECT_TRUE(f.io.quitted);
  EXPECT_EQ(closed.wait_for(0s), std::future_status::ready);
}

TEST(SchedulerCore, AnAnswerWhoseOutputsAndFailuresDoNotAddUpEndsTheJobNotTheScheduler) {
  // What a faulty or hostile node could send: too few outputs, failures out of order, twice, or
  // outside the chunk. Each ends its job with protocol_error; the core goes on with the next.
  troupe::options opts;
  opts.chunk_size = 4;
  core_fixture f{{"h:1/cpu"}, opts};
  using tamper = void (*)(chunk_result&);
  std::vector<tamper> cases = {
      [](chunk_result& r) { r.outputs = r.outputs.slice(0, 3); },
      [](chunk_result& r) {
        r.outputs = r.outputs.slice(0, 2);
        r.failures = {{r.first + 2, "x"}, {r.first + 1, "y"}};
      },
      [](chunk_result& r) {
        r.outputs = r.outputs.slice(0, 2);
        r.failures = {{r.first + 1, "x"}, {r.first + 1, "x"}};
      },
      [](chunk_result& r) {
        r.outputs = r.outputs.slice(0, 3);
        r.failures = {{r.first + 4, "x"}};
      },
      [](chunk_result& r) {
        r.failures = {{r.first, "x"}};
      },  // 4 outputs and a failure
  };
  std::uint64_t id = 1;
  for (auto bad : cases) {
    for (bool ordered : {false, true}) {
      troupe::job_options o;
      o.on_error = troupe::error_policy::skip();
      auto job = f.submit(id++, 8, ordered, o);
      ASSERT_FALSE(f.io.chunks.empty());
      auto s = std::move(f.io.chunks.front());
      f.io.chunks.clear();
      auto r = echo(s);
      bad(r);
      f.core->on_result(s.p, s.gen, s.msg.run, s.id, r);
      ASSERT_TRUE(job->done());
      EXPECT_THROW(std::rethrow_exception(job->error()), troupe::protocol_error);
      EXPECT_TRUE(f.io.to_consumer.empty());  // nothing of the answer was delivered
      f.io.to_consumer.clear();
    }
  }
  // And a well-formed job after them runs to its end.
  auto job = f.submit(id, 8, true);
  EXPECT_EQ(f.run_to_end(), test_util::iota(8));
  EXPECT_TRUE(job->done());
  EXPECT_EQ(job->error(), nullptr);
}

TEST(SchedulerCore, AProducersAnswerBringsItsNextChunkBeforeTheConsumerAcknowledges) {
  // The outputs go to the consumer and the producer gets its next chunk in the same event: a
  // job whose outputs were waiting for the consumer's room was marked as having no work, and
  // stayed so until the consumer's acknowledgement (the producers idled a consumer round trip
  // per chunk).
  troupe::options opts;
  opts.chunk_size = 10;
  core_fixture f{{"cpu"}, opts};
  auto job = f.submit(1, 100, false);
  ASSERT_EQ(f.io.chunks.size(), 2u);  // two chunks queued at the producer (min depth)
  for (int k = 0; k < 3; ++k) {
    f.answer_oldest();
    EXPECT_EQ(f.io.to_consumer.size(), static_cast<std::size_t>(k + 1));  // none acknowledged
    ASSERT_EQ(f.io.chunks.size(), 2u) << "answer " << k << ": no next chunk sent";
  }
  // The next answer fills the consumer's backlog (4 by default): the producer's next chunk
  // waits until the consumer acknowledges.
  f.answer_oldest();
  EXPECT_EQ(f.io.to_consumer.size(), 4u);
  EXPECT_EQ(f.io.chunks.size(), 1u);
  EXPECT_EQ(f.run_to_end(), test_util::iota(100));
  EXPECT_TRUE(job->done());
}

TEST(SchedulerCore, ANodesChunksGrowWithTheProducersOnNodesAndShrinkWhenTheyAreLost) {
  // Every remote chunk costs the one coordinator tens of microseconds of CPU. With 64 producers
  // on nodes, chunks of 2 ms items aim at 64 x 0.5 ms = 32 ms (16 items), so that together they
  // take at most a tenth of its core; at 16 ms (8 x the target) they took 0.2 of it. Once 48
  // nodes are lost, the 16 left aim at 16 ms again: 8 items.
  std::vector<troupe::device> where;
  for (int i = 0; i < 64; ++i) where.emplace_back("h:" + std::to_string(i + 1) + "/cpu");
  core_fixture f{where};
  auto job = f.submit(1, 1'000'000, false);
  // Answers `n` chunks (2 ms per item), oldest first; returns the sizes of the chunks sent
  // meanwhile to producers still working.
  auto answer = [&](std::size_t n) {
    std::vector<std::size_t> sizes;
    for (std::size_t k = 0; k < n && !f.io.chunks.empty(); ++k) {
      auto s = std::move(f.io.chunks.front());
      f.io.chunks.pop_front();
      if (s.gen != f.core->generation(s.p)) continue;
      auto items = s.msg.items.as<std::int64_t>()->items.size();
      auto r = echo(s, 2'000'000 * static_cast<std::int64_t>(items));
      auto before = f.io.chunks.size();
      f.core->on_result(s.p, s.gen, s.msg.run, s.id, r);
      f.consume_all();
      for (auto i = before; i < f.io.chunks.size(); ++i)
        sizes.push_back(f.io.chunks[i].msg.items.as<std::int64_t>()->items.size());
    }
    return sizes;
  };
  answer(64 * 8);
  auto grown = answer(64 * 2);
  ASSERT_FALSE(grown.empty());
  for (auto n : grown) EXPECT_EQ(n, 16u);
  for (std::size_t p = 16; p < 64; ++p) f.core->producer_down(p, "node gone", true);
  answer(16 * 16);
  auto after = answer(16 * 2);
  ASSERT_FALSE(after.empty());
  for (auto n : after) EXPECT_EQ(n, 8u);
  EXPECT_FALSE(job->done());
}

TEST(SchedulerCore, ARangeTakenBackIsNotReadByTheSchedulerEither) {
  // A handle destroyed before its job ended takes the caller's range back at once (its cancel
  // still on the way). The scheduler then reads none of it: not the item of a retry, not the
  // copy a node would get; the job ends as cancelled.
  troupe::options opts;
  opts.chunk_size = 4;
  opts.speculative = false;
  for (bool remote : {false, true}) {
    core_fixture f{{remote ? "h:1/cpu" : "cpu"}, opts};
    auto xs = test_util::iota(64);
    auto source = troupe::detail::make_job_source<std::int64_t>(troupe::lend(xs));  // lent
    auto lease = source->lease();
    ASSERT_NE(lease, nullptr);
    if (remote) lease->revoke_and_wait();  // before the first chunk goes to the node
    auto job = std::make_shared<troupe::detail::job_core>(1, caf::actor{});
    troupe::job_options o;
    o.on_error = troupe::error_policy::retry(2);
    f.core->start(job, source, false, o);
    if (!remote) {
      ASSERT_FALSE(f.io.chunks.empty());
      lease->revoke_and_wait();
      auto s = std::move(f.io.chunks.front());
      f.io.chunks.pop_front();
      chunk_result r;  // item 1 threw: a retry would copy it out of the range
      r.run = s.msg.run;
      r.first = s.msg.first;
      r.outputs = batch::of(std::vector<std::int64_t>{0, 2, 3});
      r.failures = {{s.msg.first + 1, "x"}};
      f.core->on_result(s.p, s.gen, s.msg.run, s.id, r);
    }
    ASSERT_TRUE(job->done()) << (remote ? "remote" : "retry");
    EXPECT_THROW(std::rethrow_exception(job->error()), troupe::cancelled);
  }
}

TEST(SchedulerCore, TwoJobsShareTheProducersByTheirWeights) {
  // Weights 3 and 1, both with more work than the run takes: the producer's time goes 3 : 1.
  // (With a job marked as having no work while its outputs waited for the consumer, the two
  // took turns, 1 : 1, whatever their weights.)
  troupe::options opts;
  opts.chunk_size = 1;
  core_fixture f{{"cpu", "cpu"}, opts};
  troupe::job_options heavy, light;
  heavy.weight = 3;
  light.weight = 1;
  auto a = f.submit(1, 100'000, false, heavy);
  auto b = f.submit(2, 100'000, false, light);
  std::map<std::uint64_t, int> done;
  for (int k = 0; k < 400; ++k) {
    ASSERT_FALSE(f.io.chunks.empty());
    f.io.t += 1us;
    done[f.answer_oldest()] += 1;
    f.consume_all();
  }
  EXPECT_NEAR(static_cast<double>(done[1]) / done[2], 3.0, 0.3) << done[1] << " : " << done[2];
}

}  // namespace
