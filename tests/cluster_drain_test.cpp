// A live cluster: nodes that drain while producers start, discovery by name, and churn (join
// and leave cycles, every node restarted in turn) under one running job.
#include "cluster_parts.hpp"

/// A node SIGTERMed while its producers for a runner construct (their init holds on a file):
/// `start` begins that (the runner's constructor, add_devices), on a thread of its own; the
/// node has drained (the cluster reported it) before init is let go.
struct drain_during_init {
  explicit drain_during_init(const char* name)
      : dir(::testing::TempDir() + "troupe_" + name + "_" + std::to_string(::getpid())),
        a{"cpu,cpu", {"--drain-timeout-ms", "20000"}} {
    clean();
    ::mkdir(dir.c_str(), 0700);
    cfg.set("init_hold_dir", dir);
    o.on_change = rec.callback();
  }
  ~drain_during_init() { clean(); }
  void clean() {  // not std::filesystem: see temp_cert_dir in node_test.cpp
    std::remove((dir + "/hold").c_str());
    std::remove((dir + "/constructing").c_str());
    ::rmdir(dir.c_str());
  }
  void during_init(const std::function<void()>& start) {
    std::ofstream{dir + "/hold"} << "hold\n";
    std::thread starter{start};
    {
      test_util::watchdog dog{std::chrono::seconds{60}, "a producer's init on the node"};
      while (!std::ifstream{dir + "/constructing"})
        std::this_thread::sleep_for(std::chrono::milliseconds{1});
    }
    a.kill(SIGTERM);
    rec.wait_for(troupe::membership_event::draining, a.address());
    std::remove((dir + "/hold").c_str());
    starter.join();
  }
  /// The node's exit: 0 once its producers were drained, 1 at its drain deadline.
  int exit_code() {
    test_util::watchdog dog{std::chrono::seconds{60}, "the draining node's exit"};
    int sig = -1, code = -1;
    while (!a.ended(&sig, &code)) std::this_thread::sleep_for(std::chrono::milliseconds{5});
    EXPECT_EQ(sig, 0);
    return code;
  }
  std::string dir;
  node_process a;
  troupe::config cfg = slow(1000);
  recorder rec;
  troupe::cluster_options o;
};

/// Every producer the runner had on `node` was drained (removed), none lost.
void expect_drained(const troupe::stats& s, const std::string& node, std::size_t n) {
  std::size_t seen = 0;
  for (auto& p : s.producers) {
    if (p.where.is_local() || p.where.node() != node) continue;
    ++seen;
    EXPECT_TRUE(p.removed) << p.where.str() << " was not drained";
    EXPECT_FALSE(p.alive) << p.where.str();
  }
  EXPECT_EQ(seen, n);
}

TEST(Cluster, ANodeThatDrainsWhileTheRunnerStartsIsDrainedOnceItHasStarted) {
  // CI once (cli.rolling_restart): SIGTERM reached a node while the runner that follows the
  // cluster was starting: the node's producers were constructing, and the runner's scheduler
  // did not exist yet. The node's notice that they leave was dropped, so they went on taking
  // work, and the node drained only when the runner closed (or at its drain deadline). Now the
  // notice waits for the scheduler: the node is drained as soon as the runner has started, while
  // the runner stays open and idle here.
  drain_during_init t{"drain_at_start"};
  node_process b{"cpu"};
  auto c = troupe::cluster::connect({t.a.address(), b.address()}, {}, t.o);
  std::optional<troupe::unordered_runner<remote_squares>> runner;
  t.during_init([&] { runner.emplace(c, t.cfg, troupe::options{}); });
  EXPECT_EQ(t.exit_code(), 0)
      << "the node reached its drain deadline: nobody drained its producers";
  expect_drained(runner->stats(), t.a.address(), 2);
  EXPECT_EQ(runner->run(iota(300)), sum_of_squares(300)) << "the runner goes on with node b";
  EXPECT_EQ(runner->devices(), c.devices());
}

TEST(Cluster, ANodeThatDrainsWhileAddDevicesStartsItsProducersIsDrainedOnceTheyAreAdded) {
  // The same moment for add_devices(): the scheduler exists, but it does not know the node's
  // new producers until their init has answered. It keeps the notice until they are added.
  drain_during_init t{"drain_at_add"};
  node_process b{"cpu"};
  auto c = troupe::cluster::connect({t.a.address(), b.address()}, {}, t.o);
  std::vector<troupe::device> on_a, on_b;
  for (auto& d : c.devices()) (d.node() == b.address() ? on_b : on_a).push_back(d);
  troupe::unordered_runner<remote_squares> runner{on_b, t.cfg};
  t.during_init([&] { runner.add_devices(on_a); });
  EXPECT_EQ(t.exit_code(), 0)
      << "the node reached its drain deadline: nobody drained its producers";
  expect_drained(runner.stats(), t.a.address(), 2);
  EXPECT_EQ(runner.run(iota(300)), sum_of_squares(300)) << "the runner goes on with node b";
  EXPECT_EQ(runner.devices(), on_b);
}

TEST(Cluster, ARunnerThatFollowsTheClusterStartsWithoutAMemberThatLeftAfterTheSnapshot) {
  // A fleet always has a node going: one killed after the cluster last heard from it (a probe
  // every 30 s here, so the cluster still has it up) is in the runner's starting list, and its
  // spawn fails. The runner starts on the others instead of failing; the cluster reports the
  // loss later, and a restart on that address would rejoin the runner.
  node_process a{"cpu,cpu"}, b{"cpu"};
  troupe::cluster_options o;
  o.heartbeat = std::chrono::seconds{30};
  o.lost_after = std::chrono::seconds{120};
  auto c = troupe::cluster::connect({a.address(), b.address()}, {}, o);
  ASSERT_EQ(c.devices().size(), 3u);
  a.kill(SIGKILL);
  {
    test_util::watchdog dog{std::chrono::seconds{60}, "the killed node's exit"};
    while (!a.ended()) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  }
  ASSERT_EQ(c.devices().size(), 3u) << "the cluster noticed the kill: nothing left to test";
  troupe::unordered_runner<remote_squares> runner{c, slow(100)};
  std::vector<troupe::device> on_b;
  for (auto& d : c.devices())
    if (d.node() == b.address()) on_b.push_back(d);
  EXPECT_EQ(runner.devices(), on_b);
  EXPECT_EQ(runner.run(iota(300)), sum_of_squares(300));
}

TEST(Cluster, DiscoveryNeverDrainsTheAddressesGivenToConnect) {
  // connect({a}) with discovery listing a and b: both join. When discovery stops listing a, a
  // stays (connect's own addresses are the operator's); when it stops listing b, b drains.
  node_process a{"cpu"}, b{"cpu"};
  std::mutex mtx;
  std::vector<std::string> listed{a.address(), b.address()};
  std::size_t polls = 0;
  std::condition_variable polled;
  recorder ev;
  troupe::cluster_options o;
  o.on_change = ev.callback();
  o.discover_every = std::chrono::milliseconds{20};
  o.discover = [&] {
    std::lock_guard<std::mutex> guard{mtx};
    ++polls;
    polled.notify_all();
    return listed;
  };
  auto wait_polls = [&](std::size_t n) {  // n more polls of the discovery thread
    test_util::watchdog dog{std::chrono::seconds{30}, "the discovery thread's polls"};
    std::unique_lock<std::mutex> lock{mtx};
    auto until = polls + n;
    polled.wait(lock, [&] { return polls >= until; });
  };
  auto c = troupe::cluster::connect({a.address()}, {}, o);
  EXPECT_EQ(c.devices().size(), 2u);
  {
    std::lock_guard<std::mutex> guard{mtx};
    listed = {b.address()};
  }
  wait_polls(5);
  EXPECT_EQ(ev.count(troupe::membership_event::draining, a.address()), 0u);
  EXPECT_EQ(c.devices().size(), 2u);
  {
    std::lock_guard<std::mutex> guard{mtx};
    listed = {};
  }
  ev.wait_for(troupe::membership_event::drained, b.address());
  wait_polls(3);
  EXPECT_EQ(ev.count(troupe::membership_event::draining, a.address()), 0u);
  ASSERT_EQ(c.devices().size(), 1u);
  EXPECT_EQ(c.devices()[0].str().rfind(a.address(), 0), 0u) << c.devices()[0].str();
}

/// Discovery over a name that resolves through this test's own /etc/hosts: run by
/// tests/netns_discovery.sh inside a network namespace whose /etc/netns/NAME/hosts `ip netns
/// exec` binds over /etc/hosts (the machine's own file is never touched); skipped elsewhere.
TEST(Discovery, ANameThatGainsAndLosesAddressesJoinsAndDrainsNodes) {
  const char* hosts = std::getenv("TROUPE_DISCOVERY_HOSTS");
  if (hosts == nullptr)
    GTEST_SKIP() << "runs inside a network namespace of its own: tests/netns_discovery.sh";
  auto port = test_util::free_loopback_address();
  port = port.substr(port.find(':') + 1);
  auto at = [&](int k) { return "127.0.0." + std::to_string(k) + ":" + port; };
  auto write_hosts = [&](const std::vector<int>& ks) {
    std::ofstream out(hosts, std::ios::trunc);  // in place: the bind mount keeps the inode
    out << "127.0.0.1 localhost\n";
    for (int k : ks) out << "127.0.0." << k << " nodes.troupe.test\n";
  };
  std::vector<std::unique_ptr<node_process>> nodes;
  for (int k = 2; k <= 6; ++k)
    nodes.push_back(std::make_unique<node_process>("cpu", std::vector<std::string>{}, at(k)));
  write_hosts({2, 3, 4, 5});
  std::mutex mtx;
  std::size_t failures_logged = 0;
  troupe::set_log_handler([&](troupe::log_level, const std::string& line) {
    std::lock_guard<std::mutex> guard{mtx};
    if (line.find("discovery failed") != std::string::npos) ++failures_logged;
  });
  auto polls = std::make_shared<std::atomic<int>>(0);
  auto dns = troupe::dns_discovery("nodes.troupe.test:" + port);
  recorder ev;
  troupe::cluster_options o;
  o.on_change = ev.callback();
  o.discover = [dns, polls] {
    ++*polls;
    return dns();
  };
  o.discover_every = std::chrono::milliseconds{100};
  auto c = troupe::cluster::connect({}, {}, o);
  EXPECT_EQ(c.devices().size(), 4u);
  running_job r{c, 50};
  write_hosts({2, 3, 4, 5, 6});  // a fifth address: its node takes work in the running job
  ev.wait_for(troupe::membership_event::joined, at(6));
  {
    test_util::watchdog dog{std::chrono::seconds{60}, "the discovered node's first items"};
    while (items_on(r.runner.stats(), at(6)) == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds{2});
  }
  write_hosts({2, 4, 5, 6});  // one vanishes: drained, never lost
  ev.wait_for(troupe::membership_event::drained, at(3));
  EXPECT_EQ(ev.count(troupe::membership_event::lost, at(3)), 0u);
  auto members_before = c.members().size();
  auto devices_before = c.devices().size();
  write_hosts({});  // the name resolves no more: nothing changes, logged once
  auto from = polls->load();
  {
    test_util::watchdog dog{std::chrono::seconds{30}, "five failing polls"};
    while (polls->load() < from + 5) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
  EXPECT_EQ(c.devices().size(), devices_before);
  EXPECT_EQ(c.members().size(), members_before);
  write_hosts({2, 4, 5, 6});
  r.finish();
  troupe::set_log_handler(nullptr);
  EXPECT_EQ(failures_logged, 1u);
  EXPECT_EQ(c.devices().size(), 4u);
  for (int k : {2, 4, 5, 6}) EXPECT_EQ(ev.count(troupe::membership_event::lost, at(k)), 0u);
}

TEST(Cluster, ConnectingToAFrozenNodeGivesUpAfterConnectTimeout) {
  node_process a{"cpu"};
  a.kill(SIGSTOP);
  troupe::cluster_options o;
  o.connect_timeout = std::chrono::milliseconds{1000};
  auto t0 = std::chrono::steady_clock::now();
  test_util::watchdog dog{std::chrono::seconds{30}, "connect to a frozen node"};
  EXPECT_THROW(troupe::cluster::connect({a.address()}, {}, o), troupe::node_error);
  auto took =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  std::cout << "connect to a frozen node gave up after " << took.count()
            << " ms (connect_timeout 1000 ms)\n";
  a.kill(SIGCONT);
}

TEST(Cluster, TenJoinLeaveCyclesUnderARunningJobLoseNothingAndLeakNothing) {
  node_process a{"cpu,cpu"}, b{"cpu,cpu"};
  troupe::cluster_options o;
  auto c = troupe::cluster::connect({a.address()}, {}, o);
  troupe::options opts;
  opts.speculative = false;
  auto started = flag_after(opts, 2'000);
  troupe::unordered_runner<remote_squares> runner{c, slow(20), opts};
  open_ended in;
  auto job = runner.submit(in.input(0, 20'000));
  wait_until(*started, "the job under way");
  std::size_t threads = 0, fds = 0;
  for (int cycle = 0; cycle < 10; ++cycle) {
    c.add(b.address());
    c.remove(b.address());
    if (cycle == 0) {
      threads = entries("/proc/self/task");
      fds = entries("/proc/self/fd");
    }
  }
  // What the last remove() let go may still be closing on a loaded machine: up to 5 s for it.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds{5};
  while ((entries("/proc/self/task") > threads || entries("/proc/self/fd") > fds) &&
         std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds{20});
  EXPECT_LE(entries("/proc/self/task"), threads) << "threads grew over 9 cycles";
  EXPECT_LE(entries("/proc/self/fd"), fds) << "file descriptors grew over 9 cycles";
  *in.more = true;
  auto sum = job.get();
  EXPECT_EQ(sum, sum_of_squares(in.made->load()));
  EXPECT_EQ(runner.stats().producers.size(), 2u + 10 * 2u);
}

TEST(Cluster, EveryNodeRestartedInTurnWithSigtermUnderOneJobLosesNothing) {
  // A rolling restart: each node drains on SIGTERM (exit 0) and is started again on its
  // address; the runner follows: drained, then rejoined; never lost.
  std::vector<std::string> addresses{test_util::free_loopback_address(),
                                     test_util::free_loopback_address(),
                                     test_util::free_loopback_address()};
  std::vector<std::optional<node_process>> nodes(3);
  for (std::size_t i = 0; i < 3; ++i)
    nodes[i].emplace("cpu,cpu", std::vector<std::string>{}, addresses[i]);
  recorder ev;
  troupe::cluster_options o;
  o.on_change = ev.callback();
  auto c = troupe::cluster::connect(addresses, {}, o);
  troupe::options opts;
  opts.speculative = false;
  auto started = flag_after(opts, 2'000);
  troupe::unordered_runner<remote_squares> runner{c, slow(50), opts};
  open_ended in;
  auto job = runner.submit(in.input(0, 20'000));
  wait_until(*started, "the job under way");
  for (std::size_t i = 0; i < 3; ++i) {
    nodes[i]->kill(SIGTERM);
    int sig = -1, code = -1;
    {
      test_util::watchdog dog{std::chrono::seconds{60}, "the drained node's exit"};
      while (!nodes[i]->ended(&sig, &code))
        std::this_thread::sleep_for(std::chrono::milliseconds{5});
    }
    EXPECT_EQ(sig, 0);
    EXPECT_EQ(code, 0) << "node " << i << " did not drain cleanly";
    nodes[i].reset();
    nodes[i].emplace("cpu,cpu", std::vector<std::string>{}, addresses[i]);
    ev.wait_for(troupe::membership_event::rejoined, addresses[i]);
  }
  *in.more = true;
  auto sum = job.get();
  EXPECT_EQ(sum, sum_of_squares(in.made->load()));
  for (auto& a : addresses) {
    auto kinds = ev.of(a);
    EXPECT_EQ(kinds, (std::vector<troupe::membership_event::kind>{
                         troupe::membership_event::joined, troupe::membership_event::draining,
                         troupe::membership_event::drained, troupe::membership_event::rejoined}))
        << a << " (the nodes in turn: " << addresses[0] << ", " << addresses[1] << ", "
        << addresses[2] << ")";
  }
  for (auto& m : c.members()) EXPECT_EQ(m.what, troupe::member::state::up);
  auto s = runner.stats();
  for (auto& p : s.producers) {
    if (p.index < 6) {
      EXPECT_TRUE(p.removed) << "producer " << p.index << " was not drained";
    } else {
      EXPECT_TRUE(p.alive);
    }
  }
}
