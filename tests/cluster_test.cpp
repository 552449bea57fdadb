// A live cluster under running jobs (docs/api.md, "Pools that change"): real node processes on
// loopback join, are drained, are SIGKILLed and restarted on their address, freeze, and drain
// themselves on SIGTERM, while one job runs on a runner that follows the cluster.
#include "cluster_parts.hpp"

TEST(Cluster, ANodeAddedMidJobTakesItemsInThatJob) {
  node_process a{"cpu,cpu"}, b{"cpu,cpu"};
  recorder ev;
  troupe::cluster_options o;
  o.on_change = ev.callback();
  auto c = troupe::cluster::connect({a.address()}, {}, o);
  troupe::options opts;
  opts.speculative = false;
  auto tenth = flag_after(opts, 20'000);
  troupe::unordered_runner<remote_squares> runner{c, slow(20), opts};
  auto job = runner.submit(iota(200'000));
  wait_until(*tenth, "a tenth of the job");
  auto asked = std::chrono::steady_clock::now();
  c.add(b.address());  // returns once the runner has producers there
  auto added = std::chrono::steady_clock::now();
  EXPECT_EQ(runner.devices().size(), 4u);
  {
    test_util::watchdog dog{std::chrono::seconds{60}, "the added node's first item"};
    while (items_on(runner.stats(), b.address()) == 0 && !job.done())
      std::this_thread::sleep_for(std::chrono::microseconds{200});
  }
  auto first = std::chrono::steady_clock::now();
  auto in_ms = [](auto d) { return std::chrono::duration<double, std::milli>(d).count(); };
  std::cout << "add(): " << in_ms(added - asked) << " ms until its producers were running, "
            << in_ms(first - asked) << " ms until its first items were counted\n";
  EXPECT_EQ(job.get(), sum_of_squares(200'000));
  auto s = runner.stats();
  EXPECT_GT(items_on(s, b.address()), 0u) << "the node that joined took no item";
  EXPECT_EQ(ev.of(a.address()),
            (std::vector<troupe::membership_event::kind>{troupe::membership_event::joined}));
  EXPECT_EQ(ev.of(b.address()),
            (std::vector<troupe::membership_event::kind>{troupe::membership_event::joined}));
  auto ms = c.members();
  ASSERT_EQ(ms.size(), 2u);
  for (auto& m : ms) {
    EXPECT_EQ(m.what, troupe::member::state::up);
    EXPECT_NE(m.incarnation, 0u);
  }
  EXPECT_NE(ms[0].incarnation, ms[1].incarnation);
  EXPECT_THROW(c.add(b.address()), troupe::invalid_argument);  // a member already
  // Observers see the members (troupe::metrics reads these).
  bool seen = false;
  for (auto& v : troupe::detail::cluster_views())
    if (v.members.size() == 2 && v.members[1].address == b.address()) seen = true;
  EXPECT_TRUE(seen);
}

TEST(Cluster, ANodeRemovedMidJobDrainsAndGetsNothingAfterwards) {
  node_process a{"cpu,cpu"}, b{"cpu,cpu"};
  recorder ev;
  troupe::cluster_options o;
  o.on_change = ev.callback();
  auto c = troupe::cluster::connect({a.address(), b.address()}, {}, o);
  troupe::options opts;
  opts.speculative = false;
  auto tenth = flag_after(opts, 20'000);
  troupe::unordered_runner<remote_squares> runner{c, slow(20), opts};
  auto job = runner.submit(iota(200'000));
  wait_until(*tenth, "a tenth of the job");
  c.remove(a.address());  // returns once a's producers have ended
  auto at_drain = items_on(runner.stats(), a.address());
  EXPECT_EQ(runner.devices().size(), 2u);
  EXPECT_EQ(job.get(), sum_of_squares(200'000));
  auto s = runner.stats();
  EXPECT_EQ(items_on(s, a.address()), at_drain) << "items went to the drained node";
  EXPECT_GT(at_drain, 0u);
  for (std::size_t i = 0; i < 2; ++i) EXPECT_TRUE(s.producers[i].removed);
  EXPECT_EQ(ev.of(a.address()),
            (std::vector<troupe::membership_event::kind>{troupe::membership_event::joined,
                                                         troupe::membership_event::draining,
                                                         troupe::membership_event::drained}));
  EXPECT_EQ(c.members()[0].what, troupe::member::state::drained);
  EXPECT_EQ(c.devices().size(), 2u);
  // The last node of a runner that follows the cluster is not drained: that would hang its jobs.
  EXPECT_THROW(c.remove(b.address()), troupe::invalid_argument);
  EXPECT_EQ(runner.run(iota(100)), sum_of_squares(100));
  // Added again, it takes work again.
  c.add(a.address());
  EXPECT_EQ(runner.devices().size(), 4u);
}

TEST(Cluster, ANodeKilledAndRestartedOnItsAddressRejoinsTheRunningJob) {
  auto address = test_util::free_loopback_address();
  std::optional<node_process> a;
  a.emplace("cpu,cpu", std::vector<std::string>{}, address);
  node_process b{"cpu,cpu"};
  recorder ev;
  troupe::cluster_options o;
  o.on_change = ev.callback();
  auto c = troupe::cluster::connect({a->address(), b.address()}, {}, o);
  auto first = c.members()[0].incarnation;
  troupe::options opts;
  opts.speculative = false;
  auto started = flag_after(opts, 5'000);
  troupe::unordered_runner<remote_squares> runner{c, slow(50), opts};
  open_ended in;
  auto job = runner.submit(in.input(0, 40'000));
  wait_until(*started, "the job under way");
  a->kill(SIGKILL);
  {
    test_util::watchdog dog{std::chrono::seconds{30}, "the killed node's end"};
    while (!a->ended()) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
  a.reset();
  auto restart = std::chrono::steady_clock::now();
  a.emplace("cpu,cpu", std::vector<std::string>{}, address);  // the same address
  auto up = std::chrono::steady_clock::now();
  ev.wait_for(troupe::membership_event::rejoined, address);
  auto rejoined = std::chrono::steady_clock::now();
  *in.more = true;  // 40,000 more items, then the job ends
  auto sum = job.get();
  auto n = in.made->load();
  EXPECT_EQ(sum, sum_of_squares(n));
  std::cout << "rejoined "
            << std::chrono::duration_cast<std::chrono::milliseconds>(rejoined - up).count()
            << " ms after the restarted node listened ("
            << std::chrono::duration_cast<std::chrono::milliseconds>(rejoined - restart).count()
            << " ms after its start); " << n << " items\n";
  auto s = runner.stats();
  std::uint64_t fresh = 0;
  for (auto& p : s.producers)
    if (p.index >= 4 && p.where.node() == address) fresh += p.items;
  EXPECT_GT(fresh, 0u) << "the restarted node took no item of the running job";
  auto kinds = ev.of(address);
  ASSERT_GE(kinds.size(), 3u);
  EXPECT_EQ(kinds.front(), troupe::membership_event::joined);
  EXPECT_EQ(kinds[kinds.size() - 2], troupe::membership_event::lost);
  EXPECT_EQ(kinds.back(), troupe::membership_event::rejoined);
  EXPECT_NE(c.members()[0].incarnation, first) << "a restart is a new incarnation";
}

TEST(Cluster, AKilledOrFrozenMemberIsLostWhenItsConnectionEndsNotAfterLostAfter) {
  // At many members a member's probes are seconds apart and lost_after tens of seconds
  // (probes_per_second); the watcher's monitor of each member's node actor makes a process
  // that ends (a reset connection) or freezes (CAF closes its connection after this process's
  // limits::idle_timeout, 1.5 s) lost at once. lost_after here is ten minutes: without the
  // monitor neither would be lost within the watchdogs' 30 s.
  node_process a{"cpu"}, b{"cpu", {"--idle-timeout-ms", "60000"}}, c3{"cpu"};
  recorder ev;
  troupe::cluster_options o;
  o.on_change = ev.callback();
  o.lost_after = std::chrono::minutes{10};
  o.reconnect = false;
  auto c = troupe::cluster::connect({a.address(), b.address(), c3.address()}, {}, o);
  running_job run{c, 200};
  a.kill(SIGKILL);
  expect_event(ev, troupe::membership_event::lost, a.address(), "the killed node lost");
  b.kill(SIGSTOP);
  expect_event(ev, troupe::membership_event::lost, b.address(), "the frozen node lost");
  b.kill(SIGCONT);
  EXPECT_EQ(c.nodes(), std::vector<std::string>{c3.address()});
  EXPECT_EQ(ev.count(troupe::membership_event::lost, c3.address()), 0u);
  run.finish();  // exact, on the one left
}

TEST(Cluster, DurationsOfForeverAreRefusedNotOverflowed) {
  // Each was added to a clock reading (or doubled) before it was checked.
  constexpr auto forever = std::chrono::milliseconds::max();
  for (int which = 0; which < 4; ++which) {
    troupe::cluster_options o;
    o.reconnect = false;
    (which == 0   ? o.lost_after
     : which == 1 ? o.heartbeat
     : which == 2 ? o.connect_timeout
                  : o.reconnect_every) = forever;
    EXPECT_THROW(troupe::cluster::connect({"127.0.0.1:1"}, {}, o), troupe::invalid_argument)
        << which;
  }
  EXPECT_THROW(troupe::cluster::connect(std::vector<std::string>{"127.0.0.1:1"}, {}, forever),
               troupe::invalid_argument);
  troupe::limits l;
  l.heartbeat = forever;
  EXPECT_THROW(troupe::set_network_limits(l), troupe::invalid_argument);
  l = troupe::limits{};
  l.idle_timeout = forever;
  EXPECT_THROW(troupe::set_network_limits(l), troupe::invalid_argument);
  // CAF took neither: it logged a parse error and used its default, troupe reported the value.
  l = troupe::limits{};
  l.max_message_bytes = std::size_t{4} << 30;
  EXPECT_THROW(troupe::set_network_limits(l), troupe::invalid_argument);
  l = troupe::limits{};
  l.max_connections = std::numeric_limits<std::size_t>::max();
  EXPECT_THROW(troupe::set_network_limits(l), troupe::invalid_argument);
  EXPECT_THROW(troupe::set_threads(std::numeric_limits<std::size_t>::max()),
               troupe::invalid_argument);
}

TEST(Cluster, ANodesDrainWaitsForeverWhenToldAndForItsServedDrainTimeoutByDefault) {
  test_util::watchdog dog{std::chrono::seconds{60}, "a node's drain"};
  auto marker = "/tmp/troupe_drain_marker_" + std::to_string(::getpid());
  for (bool forever : {true, false}) {
    std::remove(marker.c_str());
    troupe::node_options no;
    no.drain_timeout = std::chrono::milliseconds{200};
    auto n = forever ? troupe::node::serve("127.0.0.1:0", {"cpu"})
                     : troupe::node::serve("127.0.0.1:0", {"cpu"}, {}, no);
    troupe::config cfg;
    cfg.set("sleep_us", std::int64_t{1'500'000});
    cfg.set("work_marker", marker);
    troupe::options opts;
    opts.speculative = false;
    troupe::unordered_runner<remote_squares> runner{
        {troupe::device{n.address() + "/cpu"}}, cfg, opts};
    auto h = runner.submit(std::vector<std::int64_t>{3});
    while (!std::ifstream{marker}) std::this_thread::sleep_for(std::chrono::milliseconds{5});
    if (forever) {
      // milliseconds::max(): no deadline. It overflowed, and drain returned at once, stopping
      // the producer in its item: the job then had no producer left. And the job whose last
      // item came back as its last producer left failed, needing none ("every producer is
      // lost").
      EXPECT_EQ(n.drain(std::chrono::milliseconds::max()), 0u);
      EXPECT_EQ(h.get(), 9);
    } else {
      // node_options::drain_timeout (200 ms) is drain()'s deadline: the item (1.5 s) was still
      // running at it. drain() used to wait 30 s whatever the node's options.
      EXPECT_EQ(n.drain(), 1u);
      // (Its item may still have answered: the producer ends when work() returns.)
      EXPECT_TRUE(h.wait_for(std::chrono::seconds{30}));
    }
  }
  std::remove(marker.c_str());
}

TEST(Cluster, OfTwoNodesServedByOneProcessTheOneThatStopsIsTheOnlyOneLost) {
  // Both share the process's CAF node id (a process id and host hashes): a down is matched to
  // its member by the node actor, not by the node id, else one stop loses them both.
  auto a = troupe::node::serve("127.0.0.1:0", {"cpu"});
  auto b = troupe::node::serve("127.0.0.1:0", {"cpu"});
  recorder ev;
  troupe::cluster_options o;
  o.on_change = ev.callback();
  o.lost_after = std::chrono::minutes{10};
  o.reconnect = false;
  auto c = troupe::cluster::connect({a.address(), b.address()}, {}, o);
  auto stopped = a.address(), other = b.address();  // (a stopped node has no address)
  a.stop();
  expect_event(ev, troupe::membership_event::lost, stopped, "the stopped node lost");
  // The same down, matched by node id, would have lost b in the same batch as a.
  EXPECT_EQ(c.nodes(), std::vector<std::string>{other});
  EXPECT_EQ(ev.count(troupe::membership_event::lost, other), 0u);
}

TEST(Cluster, AnAnswerOfAFrozenNodeGivenUpOnIsDroppedAndCounted) {
  // CAF would give up on the frozen node's connection only after a minute: the job can end
  // while it is frozen only because the cluster gave up on it (lost_after) and fenced it.
  troupe::limits l;
  l.idle_timeout = std::chrono::seconds{60};
  try {
    troupe::set_network_limits(l);
  } catch (const troupe::invalid_argument&) {
    GTEST_SKIP() << "needs a process of its own (ctest runs each test alone)";
  }
  node_process a{"cpu", {"--idle-timeout-ms", "60000"}}, b{"cpu", {"--idle-timeout-ms", "60000"}};
  recorder ev;
  auto o = watched_closely(ev);
  o.reconnect = false;
  auto c = troupe::cluster::connect({a.address(), b.address()}, {}, o);
  troupe::options opts;
  opts.speculative = false;
  opts.chunk_size = 1;
  auto sent = std::make_shared<std::atomic<bool>>(false);
  opts.on_progress = [&a, &ev, sent](const troupe::progress& p) {
    if (p.done >= 10 && !sent->exchange(true)) {
      ev.mark();
      a.kill(SIGSTOP);  // mid-chunk: each takes 20 ms
    }
  };
  troupe::unordered_runner<remote_squares> runner{c, slow(20'000), opts};
  {
    test_util::watchdog dog{std::chrono::seconds{40}, "the job while node a is frozen"};
    EXPECT_EQ(runner.run(iota(200)), sum_of_squares(200));
  }
  std::cout << "frozen node reported lost " << ev.ms_after_freeze(a.address())
            << " ms after its SIGSTOP (heartbeat 100 ms, lost_after 2000 ms)\n";
  EXPECT_TRUE(a.alive()) << "still frozen, not dead";
  EXPECT_EQ(ev.count(troupe::membership_event::lost, a.address()), 1u);
  a.kill(SIGCONT);  // it finishes the chunk it held and answers: too late
  {
    test_util::watchdog dog{std::chrono::seconds{40}, "node a's late answer"};
    while (runner.stats().late_answers == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
  EXPECT_GE(runner.stats().late_answers, 1u);
  // Its process was given up on: nothing of that incarnation is used again. add() says so and
  // asks the node to start over; the new incarnation it takes is a member (as a restart's).
  auto given_up = c.members()[0].incarnation;
  EXPECT_THROW(c.add(a.address()), troupe::node_error);
  EXPECT_GE(c.fenced_answers(), 1u);
  EXPECT_EQ(c.members()[0].what, troupe::member::state::lost);
  bool back = false;
  for (int i = 0; i < 200 && !back; ++i) {  // the node handles the request as its next message
    try {
      c.add(a.address());
      back = true;
    } catch (const troupe::node_error&) {
      std::this_thread::sleep_for(std::chrono::milliseconds{20});
    }
  }
  ASSERT_TRUE(back) << "the thawed node never answered as a new incarnation";
  EXPECT_EQ(c.members()[0].what, troupe::member::state::up);
  EXPECT_NE(c.members()[0].incarnation, given_up);
  EXPECT_EQ(ev.count(troupe::membership_event::rejoined, a.address()), 1u);
  EXPECT_EQ(runner.run(iota(40)), sum_of_squares(40));  // on both nodes again
}

TEST(Cluster, ANodeFrozenPastLostAfterThenThawedRejoinsByItselfAndTakesWorkInTheRunningJob) {
  // A freeze (or a partition) that outlasts lost_after, then heals: the process is alive, with
  // the incarnation the cluster gave up on. The cluster's reconnector finds it, asks it to
  // start over (its old producers end), and admits its new incarnation (rejoined): the running
  // job uses it again. Before, it stayed lost until someone restarted it, and a fleet whose
  // nodes paused now and then ran out of producers (seen in bench/churn_soak).
  node_process a{"cpu", {"--idle-timeout-ms", "60000"}}, b{"cpu", {"--idle-timeout-ms", "60000"}};
  recorder ev;
  auto o = watched_closely(ev);
  o.reconnect_every = std::chrono::milliseconds{200};
  auto c = troupe::cluster::connect({a.address(), b.address()}, {}, o);
  running_job run{c, 200};
  auto given_up = c.members()[0].incarnation;
  a.kill(SIGSTOP);
  expect_event(ev, troupe::membership_event::lost, a.address(), "node a lost");
  a.kill(SIGCONT);
  expect_event(ev, troupe::membership_event::rejoined, a.address(), "node a rejoined");
  EXPECT_NE(c.members()[0].incarnation, given_up);
  EXPECT_EQ(c.members()[0].what, troupe::member::state::up);
  // Its new producer takes items of the job under way.
  auto on_a = [&] {
    std::uint64_t n = 0;
    for (auto& p : run.runner.stats().producers)
      if (p.alive && p.where.node() == a.address()) n += p.items;
    return n;
  };
  {
    test_util::watchdog dog{std::chrono::seconds{30}, "items on the rejoined node"};
    while (on_a() == 0) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
  EXPECT_GT(on_a(), 0u);
  EXPECT_EQ(ev.count(troupe::membership_event::lost, a.address()), 1u);
  run.finish();
}
