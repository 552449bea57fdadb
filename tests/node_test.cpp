// Several machines on loopback (docs/api.md, "Several machines"): real node processes, killed and
// frozen mid-run.
#include "node_parts.hpp"

TROUPE_REGISTER_JOB(remote_squares);
TROUPE_REGISTER_JOB(remote_folded_squares);
TROUPE_REGISTER_JOB(remote_batch_squares);
TROUPE_REGISTER_JOB(remote_blobs);
TROUPE_REGISTER_JOB(remote_index);
#ifdef TROUPE_WITH_TORCH
TROUPE_REGISTER_JOB(remote_tensors);
#endif

namespace {

/// A job this program registers and the test nodes do not.
struct only_here {
  struct producer {
    std::int64_t work(std::int64_t x) { return x; }
  };
};
TROUPE_REGISTER_JOB(only_here);

/// The test nodes register a "mismatched" job of other types (int64 -> int64).
struct string_mismatched {
  struct producer {
    std::int64_t work(const std::string& s) { return static_cast<std::int64_t>(s.size()); }
  };
};
[[maybe_unused]] const bool mismatched_registered =
    troupe::register_job_type<string_mismatched>("mismatched");

}  // namespace

TEST(Nodes, TwoNodesPlusLocalProducersGiveTheLocalResult) {
  node_process a{"cpu,cpu"}, b{"cpu"};
  auto c = troupe::cluster::connect({a.address(), b.address()});
  ASSERT_EQ(c.devices().size(), 3u);
  EXPECT_EQ(c.devices()[0], troupe::device{a.address() + "/cpu"});
  auto devices = c.devices();
  devices.push_back("cpu");
  // Without speculative copies, so that the fast local producer cannot answer every chunk the
  // nodes hold (under load it can finish first): each node then answers what it was sent.
  troupe::options opts;
  opts.speculative = false;
  troupe::ordered_runner<remote_squares> runner{devices, {}, opts};
  EXPECT_EQ(runner.run(iota(5000)), sum_of_squares(5000));
  EXPECT_EQ(runner.run(iota(10)), sum_of_squares(10));  // several runs
  auto s = runner.stats();
  std::uint64_t remote_items = 0;
  for (std::size_t i = 0; i < 3; ++i) remote_items += s.producers[i].items;
  EXPECT_GT(remote_items, 0u);  // the nodes did take work
}

TEST(Nodes, LargeItemsAreSplitAndJoinedBothWays) {
  node_process a{"cpu"};
  auto c = troupe::cluster::connect({a.address()});
  std::vector<std::vector<std::int64_t>> items{{}, {7}};
  for (std::int64_t k = 0; k < 5; ++k) {  // 3.1 to 4.7 MB each, odd sizes
    std::vector<std::int64_t> v(static_cast<std::size_t>(393'223 + 50'000 * k));
    std::iota(v.begin(), v.end(), k * 1'000'000);
    items.push_back(std::move(v));
  }
  auto before = troupe::bulk::totals();
  troupe::ordered_runner<remote_blobs> runner{c.devices()};
  auto out = runner.run(items);
  ASSERT_EQ(out.size(), items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    auto want = items[i];
    for (auto& x : want) x = 3 * x + 1;
    EXPECT_EQ(out[i], want) << "item " << i;
  }
  auto after = troupe::bulk::totals();
  EXPECT_GT(after.sent, before.sent);      // chunks went out as fragments
  EXPECT_GT(after.joined, before.joined);  // and outputs came back as fragments
  EXPECT_EQ(troupe::bulk::pending_streams(), 0u);
}

#ifdef TROUPE_WITH_TORCH
TEST(Nodes, TensorsCrossAsRawBytesExactly) {
  node_process a{"cpu"};
  auto c = troupe::cluster::connect({a.address()});
  std::vector<at::Tensor> inputs{
      at::arange(0, (3 << 18) + 7, at::kFloat),                            // 3 MiB, odd size
      at::arange(0, 512 * 1024, at::kDouble).reshape({512, 1024}),         // 4 MiB, 2-d
      at::arange(0, (1 << 20) + 3, at::kInt).to(at::kChar),                // 1 MiB + 3, int8
      at::arange(0, 6, at::kLong).reshape({2, 3}).t(),                     // small, not contiguous
      at::empty({0, 4}, at::kFloat),                                       // empty
      at::randn({(1 << 22) + 1}, at::kFloat).slice(0, 1, (1 << 22) + 1)};  // 16 MiB, offset view
  auto before = troupe::bulk::totals();
  troupe::ordered_runner<remote_tensors> runner{c.devices()};
  auto out = runner.run(inputs);
  ASSERT_EQ(out.size(), inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_EQ(out[i].scalar_type(), inputs[i].scalar_type()) << "tensor " << i;
    EXPECT_EQ(out[i].sizes(), inputs[i].sizes()) << "tensor " << i;
    EXPECT_TRUE(at::equal(out[i], inputs[i] * 2)) << "tensor " << i;
    if (out[i].nbytes() >= troupe::bulk::block_min) {  // joined in place, at an aligned offset
      auto address = reinterpret_cast<std::uintptr_t>(out[i].data_ptr());
      EXPECT_EQ(address % troupe::bulk::alignment, 0u) << "tensor " << i;
    }
  }
  EXPECT_GT(troupe::bulk::totals().joined, before.joined);
  EXPECT_EQ(troupe::bulk::pending_streams(), 0u);
}
#endif

TEST(Nodes, SigkillOfOneNodeMidRunStillGivesTheExactResult) {
  node_process a{"cpu,cpu"}, b{"cpu,cpu"};
  auto c = troupe::cluster::connect({a.address(), b.address()});
  troupe::options opts;
  signal_after(a, opts, SIGKILL, 200);
  // The loss reaches the application without a log handler (on the scheduler's thread).
  auto lost = std::make_shared<std::vector<std::size_t>>();
  opts.on_event = [lost](const troupe::producer_event& e) {
    if (e.what == troupe::producer_event::kind::lost) lost->push_back(e.producer);
  };
  auto all = c.devices();
  troupe::unordered_runner<remote_squares> runner{all, slow(2000), opts};
  EXPECT_EQ(runner.devices(), all);
  EXPECT_EQ(runner.run(iota(1000)), sum_of_squares(1000));
  auto s = runner.stats();
  EXPECT_FALSE(s.producers[0].alive);
  EXPECT_TRUE(s.producers[2].alive);
  // A runner over a device list (no cluster to say the node is lost) lists the lost node's
  // producers no more: before, they stayed until its next add_devices or remove_devices.
  EXPECT_EQ(runner.devices(), (std::vector<troupe::device>{all[2], all[3]}));
  runner.close();  // no more events: the vector is read after the scheduler has ended
  std::sort(lost->begin(), lost->end());
  EXPECT_EQ(*lost, (std::vector<std::size_t>{0, 1}));  // node a's two producers, once each
}

TEST(Nodes, ASigtermedNodeDrainsItsProducersAndTheJobLosesNothing) {
  // An operator's rolling restart: SIGTERM to a node mid-job. The node tells the coordinator
  // its producers are leaving; they take no new work, finish their chunks, run end() and are
  // reported removed (never lost); the node then exits 0. Nothing is lost or counted twice.
  node_process a{"cpu,cpu"}, b{"cpu,cpu"};
  auto c = troupe::cluster::connect({a.address(), b.address()});
  troupe::options opts;
  opts.speculative = false;
  signal_after(a, opts, SIGTERM, 300);
  auto events = std::make_shared<std::vector<troupe::producer_event>>();
  opts.on_event = [events](const troupe::producer_event& e) { events->push_back(e); };
  troupe::unordered_runner<remote_squares> runner{c.devices(), slow(1000), opts};
  EXPECT_EQ(runner.run(iota(3000)), sum_of_squares(3000));
  test_util::watchdog dog{std::chrono::seconds{60}, "the drained node's exit"};
  int sig = -1, code = -1;
  while (!a.ended(&sig, &code)) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  EXPECT_EQ(sig, 0) << "the node died of a signal instead of draining";
  EXPECT_EQ(code, 0);
  auto s = runner.stats();
  EXPECT_TRUE(s.producers[0].removed);
  EXPECT_TRUE(s.producers[1].removed);
  EXPECT_TRUE(s.producers[2].alive);
  EXPECT_TRUE(s.producers[3].alive);
  EXPECT_EQ(runner.run(iota(100)), sum_of_squares(100)) << "the runner goes on with node b";
  runner.close();  // no more events
  std::vector<std::size_t> removed;
  for (auto& e : *events) {
    EXPECT_NE(e.what, troupe::producer_event::kind::lost) << "a graceful leave reported lost";
    if (e.what == troupe::producer_event::kind::removed) removed.push_back(e.producer);
  }
  std::sort(removed.begin(), removed.end());
  EXPECT_EQ(removed, (std::vector<std::size_t>{0, 1}));
}

TEST(Nodes, AProducerOnANodeGetsItsIndexInTheCoordinatorsList) {
  node_process a{"cpu,cpu"};
  auto c = troupe::cluster::connect({a.address()});
  std::vector<troupe::device> devices{"cpu"};
  for (auto& d : c.devices()) devices.push_back(d);  // indices 1 and 2 are on the node
  troupe::options opts;
  opts.chunk_size = 1;
  troupe::unordered_runner<remote_index> runner{devices, {}, opts};
  std::set<std::int64_t> seen;
  for (int round = 0; round < 100 && seen.size() < 3; ++round)
    for (auto i : runner.run(iota(200))) seen.insert(i);
  EXPECT_EQ(seen, (std::set<std::int64_t>{0, 1, 2}));
}

TEST(Nodes, AnOrderedStreamStaysInOrderWhenANodeIsKilledMidJob) {
  node_process a{"cpu,cpu"}, b{"cpu,cpu"};
  auto c = troupe::cluster::connect({a.address(), b.address()});
  troupe::options opts;
  signal_after(a, opts, SIGKILL, 200);
  troupe::ordered_runner<remote_squares> runner{c.devices(), slow(2000), opts};
  // Node a's chunks are re-sent to node b after it dies: the outputs keep their input order,
  // each exactly once.
  std::int64_t i = 0;
  troupe::job_report report;
  {
    auto s = runner.stream(iota(1000));
    for (auto y : s) {
      ASSERT_EQ(y, i * i);
      ++i;
    }
    report = s.report();
  }
  EXPECT_EQ(i, 1000);
  EXPECT_FALSE(runner.stats().producers[0].alive);
  EXPECT_EQ(report.delivered, 1000u);
}

TEST(Nodes, SigstopOfOneNodeMidRunGivesTheExactResult) {
  node_process a{"cpu,cpu"}, b{"cpu,cpu"};
  auto c = troupe::cluster::connect({a.address(), b.address()});
  troupe::options opts;
  signal_after(a, opts, SIGSTOP, 200);
  troupe::ordered_runner<remote_squares> runner{c.devices(), slow(2000), opts};
  // Heartbeats give the frozen node up after ~1.5 s; its chunks go to the other node.
  EXPECT_EQ(runner.run(iota(1000)), sum_of_squares(1000));
  // The run may end first (an idle producer takes the frozen node's chunks as speculative
  // copies); the heartbeats give the node up all the same.
  for (int i = 0; i < 400 && runner.stats().producers[0].alive; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_FALSE(runner.stats().producers[0].alive);
}

TEST(Nodes, AProducerHungInsideWorkIsGivenUpOnWithWorkTimeout) {
  node_process a{"cpu,cpu"};
  auto c = troupe::cluster::connect({a.address()});
  troupe::config cfg;
  cfg.set("hang_on", std::int64_t{5});  // one producer on the node never returns from item 5,
  troupe::options opts;                 // while the node itself keeps answering heartbeats
  opts.work_timeout = std::chrono::milliseconds{1000};
  opts.speculative = false;  // else an idle producer may take the stuck chunk first
  troupe::unordered_runner<remote_squares> runner{c.devices(), cfg, opts};
  EXPECT_EQ(runner.run(iota(300)), sum_of_squares(300));  // item 5 retried, exactly once
  auto s = runner.stats();
  EXPECT_NE(s.producers[0].alive, s.producers[1].alive);  // only the stuck one was given up on
  EXPECT_EQ(runner.run(iota(20)), sum_of_squares(20));
}

TEST(Nodes, AProducerHungInsideWorkIsStillCopiedAfterItsNodeTrimmedItsChunk) {
  // Late chunks on nodes are trimmed by their node first; a producer stuck in an item keeps
  // every item it claimed, and its node answers each trim "nothing taken". After 10 target
  // chunk times of that, the rest is copied to the idle producer (speculation), as before
  // trims: the job ends, exact, with no work_timeout set.
  node_process a{"cpu,cpu"};
  auto c = troupe::cluster::connect({a.address()});
  auto cfg = slow(100);
  cfg.set("hang_on", std::int64_t{2500});
  troupe::options opts;
  opts.close_timeout = std::chrono::milliseconds{500};  // the stuck producer is left behind
  troupe::unordered_runner<remote_squares> runner{c.devices(), cfg, opts};
  EXPECT_EQ(runner.run(iota(3000)), sum_of_squares(3000));
  auto s = runner.stats();
  std::cout << s.trims_sent << " trims sent, " << s.split_chunks << " chunks split, "
            << s.duplicated_items << " items copied\n";
  EXPECT_GT(s.duplicated_items, 0u) << "the stuck item was copied";
}

TEST(Nodes, LosingEveryNodeIsNodeErrorAndANewNodeCanBeUsed) {
  {
    node_process a{"cpu"};
    auto c = troupe::cluster::connect({a.address()});
    troupe::options opts;
    signal_after(a, opts, SIGKILL, 50);
    troupe::unordered_runner<remote_squares> runner{c.devices(), slow(2000), opts};
    try {
      runner.run(iota(1000));
      FAIL() << "expected node_error";
    } catch (const troupe::node_error& e) {
      EXPECT_NE(std::string{e.what()}.find(a.address()), std::string::npos) << e.what();
    }
    EXPECT_THROW(runner.run({1}), troupe::node_error);  // still no producer: no hang
  }
  node_process fresh{"cpu"};  // nothing to restart: a new connect just works
  auto c = troupe::cluster::connect({fresh.address()});
  troupe::unordered_runner<remote_squares> runner{c.devices()};
  EXPECT_EQ(runner.run(iota(100)), sum_of_squares(100));
}

TEST(Nodes, UnreachableNodesAndUnknownJobsAreClearErrors) {
  try {
    troupe::cluster::connect({"127.0.0.1:1"});
    FAIL();
  } catch (const troupe::node_error& e) {
    EXPECT_NE(std::string{e.what()}.find("127.0.0.1:1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(troupe::cluster::connect({"no-port"}), troupe::invalid_argument);
  // Port 0 is no node's port (it was looked up, then every connect failed with "ip_connect"),
  // and a negative drain_timeout no deadline (SIGTERM stopped the node at once).
  EXPECT_THROW(troupe::dns_discovery("nodes.example:0"), troupe::invalid_argument);
  troupe::node_options no;
  no.drain_timeout = std::chrono::milliseconds{-1};
  EXPECT_THROW(troupe::node::serve("127.0.0.1:0", {"cpu"}, {}, no), troupe::invalid_argument);
  // A port in use says so, in the system's words (CAF says "tcp socket creation failed").
  {
    int l = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::bind(l, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
    ASSERT_EQ(::listen(l, 1), 0);
    socklen_t len = sizeof sa;
    ::getsockname(l, reinterpret_cast<sockaddr*>(&sa), &len);
    auto taken = "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
    try {
      troupe::node::serve(taken, {"cpu"});
      ADD_FAILURE() << "served on a port in use";
    } catch (const troupe::node_error& e) {
      EXPECT_NE(std::string{e.what()}.find("in use"), std::string::npos) << e.what();
    }
    ::close(l);
  }
  node_process a{"cpu"};
  try {
    troupe::unordered_runner<only_here> runner{std::vector<troupe::device>{a.address() + "/cpu"}};
    FAIL();
  } catch (const troupe::node_error& e) {
    EXPECT_NE(std::string{e.what()}.find("does not run job 'only_here'"), std::string::npos)
        << e.what();
  }
  try {
    troupe::unordered_runner<string_mismatched> runner{
        std::vector<troupe::device>{a.address() + "/cpu"}};
    FAIL();
  } catch (const troupe::node_error& e) {
    EXPECT_NE(std::string{e.what()}.find("job 'mismatched' here takes"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(troupe::unordered_runner<remote_squares>(
                   std::vector<troupe::device>{a.address() + "/cuda:0"}),
               troupe::device_unavailable);
}

namespace {
void send_raw(std::uint16_t port, const std::string& bytes) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  (void)!write(fd, bytes.data(), bytes.size());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  close(fd);
}
}  // namespace

TEST(Nodes, GarbageOnTheNodePortLeavesItServing) {
  node_process a{"cpu"};
  std::mt19937 rng{42};
  std::string noise(64 * 1024, '\0');
  for (auto& ch : noise) ch = static_cast<char>(rng());
  send_raw(a.port(), noise);
  send_raw(a.port(), std::string(3, '\0'));  // a truncated frame
  // A header-sized frame announcing a 4 GiB payload that never comes.
  std::string huge(40, '\0');
  for (int i = 4; i < 8; ++i) huge[i] = '\xff';
  send_raw(a.port(), huge);
  auto c = troupe::cluster::connect({a.address()});
  troupe::unordered_runner<remote_squares> runner{c.devices()};
  EXPECT_EQ(runner.run(iota(100)), sum_of_squares(100));
}

TEST(Nodes, BatchProducersOnANodeWithBatchingGiveTheLocalResult) {
  // Dynamic batching shares calls across jobs on local producers; a node's producers get
  // chunks as without it: the same results, for many small jobs at once and one large one.
  node_process a{"cpu,cpu"};
  auto c = troupe::cluster::connect({a.address()});
  auto devices = c.devices();
  devices.push_back("cpu");
  troupe::options opts;
  opts.batching.max_items = 8;
  opts.batching.max_delay = std::chrono::microseconds{500};
  // No speculative copies: a node process starved for a moment would see the fast local
  // producer copy its chunks and win every one, and the node take no item.
  opts.speculative = false;
  troupe::unordered_runner<remote_batch_squares> runner{devices, {}, opts};
  std::vector<troupe::job_handle<std::int64_t>> jobs;
  for (std::int64_t i = 0; i < 200; ++i)
    jobs.push_back(runner.submit(std::vector<std::int64_t>{i}));
  for (std::int64_t i = 0; i < 200; ++i) EXPECT_EQ(jobs[static_cast<std::size_t>(i)].get(), i * i);
  EXPECT_EQ(runner.run(iota(5000)), sum_of_squares(5000));
  std::uint64_t remote = 0;
  for (auto& p : runner.stats().producers)
    if (!p.where.is_local()) remote += p.items;
  EXPECT_GT(remote, 0u) << "the node took no item";
}
