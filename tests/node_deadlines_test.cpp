// Hostile peers and timing, continued: nodes that never or slowly answer, bad ports and
// addresses, and fuzzed replays of a real session (the raw BASP tools of node_parts.hpp).
#include "node_parts.hpp"

TEST(NodesHostile, ANodeThatNeverAnswersIsANodeErrorWithinTheDeadline) {
  std::uint16_t port = 0;
  int listener = raw_listen(port);  // accepts (the kernel does), never answers
  auto address = "127.0.0.1:" + std::to_string(port);
  const auto deadline = std::chrono::milliseconds{1000};
  auto start = std::chrono::steady_clock::now();
  try {
    troupe::cluster::connect({address}, {}, deadline);
    ADD_FAILURE() << "expected node_error";
  } catch (const troupe::node_error& e) {
    EXPECT_NE(std::string{e.what()}.find("no answer within 1000 ms"), std::string::npos)
        << e.what();
  }
  // (5 s to spare for a loaded machine's teardown: without the deadline it waited for ever.)
  EXPECT_LT(std::chrono::steady_clock::now() - start, deadline + std::chrono::seconds{5});
  close(listener);
  // The process is not left in a bad state: a real node is used right after.
  node_process a{"cpu"};
  expect_serves(a.address());
}

TEST(NodesHostile, ANodeSlowToAnswerIsWaitedForWithinTheDeadline) {
  node_process a{"cpu"};
  a.kill(SIGSTOP);  // the kernel still accepts the connection; the node answers 800 ms late
  std::thread resume{[&a] {
    std::this_thread::sleep_for(std::chrono::milliseconds{800});
    a.kill(SIGCONT);
  }};
  try {
    auto c = troupe::cluster::connect({a.address()}, {}, std::chrono::seconds{5});
    troupe::unordered_runner<remote_squares> runner{c.devices()};
    EXPECT_EQ(runner.run(iota(100)), sum_of_squares(100));
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
  resume.join();
}

TEST(NodesHostile, PortsAndAddressesAreCheckedWithClearErrors) {
  try {
    troupe::cluster::connect({"127.0.0.1"});
    FAIL();
  } catch (const troupe::invalid_argument& e) {
    EXPECT_NE(std::string{e.what()}.find("the port is missing"), std::string::npos) << e.what();
  }
  EXPECT_THROW(troupe::device{"127.0.0.1:123456789012345678901234567890/cpu"},
               troupe::invalid_argument);
  EXPECT_THROW(troupe::device{"127.0.0.1:65536/cpu"}, troupe::invalid_argument);
  EXPECT_NO_THROW(troupe::device{"127.0.0.1:65535/cpu"});
  troupe::limits l;
  l.max_message_bytes = 1 << 20;  // below troupe's own 1 MiB fragments plus headroom
  EXPECT_THROW(troupe::set_network_limits(l), troupe::invalid_argument);
  l = {};
  l.max_connections = 0;
  EXPECT_THROW(troupe::set_network_limits(l), troupe::invalid_argument);
  EXPECT_NO_THROW(troupe::set_network_limits(troupe::limits{}));
}

// Captures a real coordinator's session with a node (through a relay), then replays mutated
// versions of it against another node. TROUPE_FUZZ_SESSIONS sets how many (default 150),
// TROUPE_FUZZ_SEED the mutations; TROUPE_FUZZ_REPLAY=FILE,... replays dumped sessions.
TEST(NodesHostile, FuzzedReplaysOfARealSessionLeaveTheNodeServing) {
  node_process capture_node{"cpu,cpu"};
  std::string captured;
  {
    recording_relay relay{capture_node.port()};
    auto relay_address = "127.0.0.1:" + std::to_string(relay.port());
    auto c = troupe::cluster::connect({relay_address});
    troupe::unordered_runner<remote_squares> squares{c.devices()};
    EXPECT_EQ(squares.run(iota(300)), sum_of_squares(300));
    std::vector<std::int64_t> big(300'000);  // 2.4 MB: bulk fragments
    std::iota(big.begin(), big.end(), 1);
    troupe::ordered_runner<remote_blobs> blobs{c.devices()};
    EXPECT_EQ(blobs.run(std::vector<std::vector<std::int64_t>>{big, {1, 2, 3}}).size(), 2u);
    captured = relay.client_bytes();
  }
  // Replays must not claim this process's node id: it is rewritten (wire_attack.hpp).
  auto session = replayable_frames(captured, troupe::detail::network_system({}), 0x5a);
  ASSERT_GT(session.size(), 10u) << captured.size() << " bytes captured";
  std::size_t sessions = 150;
  if (auto* n = std::getenv("TROUPE_FUZZ_SESSIONS")) sessions = std::stoul(n);
  node_process target{"cpu,cpu"};
  std::this_thread::sleep_for(std::chrono::milliseconds{200});
  auto rss_before = proc_status(target.pid(), "VmRSS");
  long rss_peak = rss_before;
  std::uint64_t seed = 20261122;  // TROUPE_FUZZ_SEED: another sequence of mutations
  if (auto* x = std::getenv("TROUPE_FUZZ_SEED")) seed = std::stoull(x);
  std::mt19937_64 rng{seed};
  // TROUPE_FUZZ_REPLAY=FILE,...: replays those sessions (as dumped below) instead.
  std::vector<std::string> replays;
  if (auto* files = std::getenv("TROUPE_FUZZ_REPLAY")) {
    std::istringstream list{files};
    for (std::string file; std::getline(list, file, ',');) {
      std::ifstream in{file, std::ios::binary};
      replays.emplace_back(std::istreambuf_iterator<char>{in}, std::istreambuf_iterator<char>{});
    }
  }
  if (!replays.empty()) sessions = replays.size();
  std::deque<std::string> recent;  // the last sessions, dumped when the node fails
  auto dump = [&] {
    std::string dir = "/tmp/troupe-fuzz-" + std::to_string(getpid());
    std::filesystem::create_directories(dir);
    for (std::size_t k = 0; k < recent.size(); ++k)
      std::ofstream{dir + "/session-" + std::to_string(k) + ".bin", std::ios::binary} << recent[k];
    return " (last " + std::to_string(recent.size()) + " sessions in " + dir + ")";
  };
  for (std::size_t i = 0; i < sessions; ++i) {
    auto bytes = replays.empty() ? mutate(session, rng) : replays[i];
    recent.push_back(bytes);
    if (recent.size() > 8) recent.pop_front();
    int fd = -1;
    try {
      fd = raw_connect(target.port());
    } catch (const std::exception& e) {
      recent.pop_back();
      FAIL() << "session " << i << ": " << e.what() << (target.alive() ? "" : " (node died)")
             << dump();
    }
    send_all(fd, bytes);
    closed_by_peer_within(fd, std::chrono::milliseconds{20});
    close(fd);
    ASSERT_TRUE(target.alive()) << "node died in session " << i << dump();
    rss_peak = std::max(rss_peak, proc_status(target.pid(), "VmRSS"));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds{300});
  ASSERT_TRUE(target.alive());
  EXPECT_LT(rss_peak - rss_before, 256 * 1024) << "kB, before " << rss_before;
  std::printf(
      "fuzz: seed %llu, %zu sessions of %zu captured messages (%zu bytes), node RSS %ld "
      "-> peak %ld kB\n",
      static_cast<unsigned long long>(seed), sessions, session.size(), captured.size(), rss_before,
      rss_peak);
  expect_serves(target.address());
}
