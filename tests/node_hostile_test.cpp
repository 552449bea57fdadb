// -- hostile peers (issue "Hostile networks and hostile timing") --------------------------------
//
// Raw sockets on loopback speak (broken) BASP, CAF's wire protocol, to real node processes and
// to this process as a coordinator. Each of these tests fails against an unpatched CAF 0.17.6
// (see third_party/caf/README.md): the process crashes, grows by gigabytes, spins or never
// closes the connection.
#include "node_parts.hpp"

TEST(NodesHostile, HandshakeHeadersWithoutPayloadLeaveTheNodeServing) {
  node_process a{"cpu"};
  // A client handshake announcing no payload; a server handshake (non-zero operation data,
  // the protocol version) announcing none. Each is one 32-byte packet.
  for (auto& packet : {basp_header(basp::message_type::client_handshake, 0, 0, 0, 0, 0),
                       basp_header(basp::message_type::server_handshake, 0, 0, 1, 0, 0)}) {
    int fd = raw_connect(a.port());
    ASSERT_TRUE(send_all(fd, packet));
    EXPECT_TRUE(closed_by_peer_within(fd, std::chrono::seconds{5}));  // refused at once
    close(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds{100});
  ASSERT_TRUE(a.alive());
  expect_serves(a.address());
}

TEST(NodesHostile, AFakeNodeAnsweringWithAnEmptyHandshakeIsANodeError) {
  for (auto& answer : {basp_header(basp::message_type::server_handshake, 0, 0, 1, 0, 0),
                       basp_header(basp::message_type::client_handshake, 0, 0, 0, 0, 0)}) {
    std::uint16_t port = 0;
    int listener = raw_listen(port);
    std::thread fake{[listener, answer] {
      int fd = accept(listener, nullptr, nullptr);
      if (fd < 0) return;
      timeval tv{0, 100'000};
      setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      send_all(fd, answer);
      closed_by_peer_within(fd, std::chrono::seconds{10});
      close(fd);
    }};
    auto address = "127.0.0.1:" + std::to_string(port);
    try {
      troupe::cluster::connect({address}, {}, std::chrono::seconds{5});
      ADD_FAILURE() << "expected node_error";
    } catch (const troupe::node_error& e) {
      EXPECT_NE(std::string{e.what()}.find(address), std::string::npos) << e.what();
      EXPECT_NE(std::string{e.what()}.find("protocol"), std::string::npos) << e.what();
    }
    fake.join();
    close(listener);
  }
}

TEST(NodesHostile, FourGiBLengthHeadersDoNotGrowTheNode) {
  node_process a{"cpu"};
  // How many connections announce 4 GiB at once (4; fewer when checking an unpatched CAF, which
  // zero-fills 4 GiB per connection).
  int bombs = 4;
  if (auto* n = std::getenv("TROUPE_TEST_LENGTH_BOMBS")) bombs = std::atoi(n);
  std::this_thread::sleep_for(std::chrono::milliseconds{200});
  auto rss_before = proc_status(a.pid(), "VmRSS");
  std::vector<int> fds;
  for (int i = 0; i < bombs; ++i) {
    fds.push_back(raw_connect(a.port()));
    // Half a handshake of 4 GiB, half a message of 4 GiB (before any handshake).
    auto op =
        i % 2 == 0 ? basp::message_type::client_handshake : basp::message_type::direct_message;
    ASSERT_TRUE(send_all(fds.back(), basp_header(op, 0, 0xffffffffu, 0, 0, i % 2 == 0 ? 0 : 1)));
  }
  for (int fd : fds) {
    EXPECT_TRUE(closed_by_peer_within(fd, std::chrono::seconds{10}));
    close(fd);
  }
  auto rss_after = proc_status(a.pid(), "VmRSS");
  ASSERT_TRUE(a.alive());
  EXPECT_LT(rss_after - rss_before, 256 * 1024) << "kB, before " << rss_before;
  expect_serves(a.address());
}

TEST(NodesHostile, SpawnRequestsWithAForeignOwnerAreRefused) {
  node_process a{"cpu,cpu"};
  auto& sys = troupe::detail::network_system({});
  int fd = raw_connect(a.port());
  // We are node "fake coordinator"; the owners we name live on "never connected".
  auto node_actor = basp_handshake_as(fd, sys, fake_node_id(4242, 'c'));
  auto never_connected = fake_node_id(4343, 'n');
  // spawn_producer with a null owner, then the owner's bytes (actor id, node id) rewritten to
  // an actor on "never connected".
  troupe::spawn_producer req{
      "remote_squares", troupe::find_job("remote_squares").signature, "cpu", {}};
  auto null_owner = serialized(sys, caf::actor_id{0}, caf::node_id{});
  auto foreign_owner = serialized(sys, caf::actor_id{77}, never_connected);
  auto payload =
      serialized(sys, std::vector<caf::strong_actor_ptr>{}, caf::make_message(req, caf::actor{}));
  ASSERT_GT(payload.size(), null_owner.size());
  ASSERT_EQ(payload.substr(payload.size() - null_owner.size()), null_owner);
  payload = payload.substr(0, payload.size() - null_owner.size()) + foreign_owner;
  auto threads_before = proc_status(a.pid(), "Threads");
  const int requests = 500;
  std::string stream;
  for (int i = 0; i < requests; ++i)
    stream += basp_request(static_cast<std::uint64_t>(i + 1), 7, node_actor, payload);
  ASSERT_TRUE(send_all(fd, stream));
  // Every request is answered with the refusal (read until all 500 came, with heartbeats so
  // that the node keeps the connection).
  const std::string refusal = "owner must be an actor of the requesting coordinator";
  std::string replies;
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds{30};
  auto count = [&] {
    std::size_t n = 0;
    for (auto at = replies.find(refusal); at != std::string::npos;
         at = replies.find(refusal, at + 1))
      ++n;
    return n;
  };
  while (count() < requests && std::chrono::steady_clock::now() < until) {
    send_all(fd, basp_header(basp::message_type::heartbeat, 0, 0, 0, 0, 0));
    closed_by_peer_within(fd, std::chrono::milliseconds{100}, &replies);
  }
  EXPECT_EQ(count(), static_cast<std::size_t>(requests));
  EXPECT_LE(proc_status(a.pid(), "Threads"), threads_before);  // no producer was spawned
  close(fd);
  expect_serves(a.address());  // a real coordinator still gets its producers
}

TEST(NodesHostile, TrimsFromAnotherCoordinatorAreRefusedWhileTheOwnersJobRuns) {
  // A peer that is not the producers' coordinator sends trim_atom (options::split_late_chunks on
  // nodes) for every producer id and cut id it can guess while the owner's job runs: a trim it
  // got through would take the owner's items (all = true, also of chunks not started yet).
  // Every one is refused (-1), and the owner's job is exact.
  test_util::watchdog dog{std::chrono::seconds{120}, "hostile trims"};
  node_process a{"cpu"};
  auto c = troupe::cluster::connect({a.address()});
  troupe::options opts;
  auto started = std::make_shared<std::atomic<bool>>(false);
  opts.on_progress = [started](const troupe::progress& p) {
    if (p.done > 0) *started = true;
  };
  troupe::unordered_runner<remote_squares> runner{c.devices(), slow(2000), opts};
  std::int64_t got = 0;
  std::thread job{[&] { got = runner.run(iota(600)); }};
  while (!*started) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  auto& sys = troupe::detail::network_system({});
  int fd = raw_connect(a.port());
  auto node_actor = basp_handshake_as(fd, sys, fake_node_id(4242, 'h'));
  std::string stream;
  std::uint64_t id = 0;
  for (std::uint64_t producer = 1; producer <= 128; ++producer)
    for (std::uint64_t cut = 0; cut < 48; ++cut)
      stream += basp_request(++id, 7, node_actor,
                             serialized(sys, std::vector<caf::strong_actor_ptr>{},
                                        caf::make_message(troupe::trim_atom::value, producer, cut,
                                                          std::uint64_t{1000}, true, true)));
  ASSERT_TRUE(send_all(fd, stream));
  const std::string refused = serialized(sys, caf::make_message(std::int64_t{-1}));
  std::string replies;
  auto count = [&] {
    std::size_t n = 0;
    for (auto at = replies.find(refused); at != std::string::npos;
         at = replies.find(refused, at + 1))
      ++n;
    return n;
  };
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds{30};
  while (count() < id && std::chrono::steady_clock::now() < until) {
    send_all(fd, basp_header(basp::message_type::heartbeat, 0, 0, 0, 0, 0));
    closed_by_peer_within(fd, std::chrono::milliseconds{100}, &replies);
  }
  EXPECT_EQ(count(), id) << "trims answered otherwise than refused: taken";
  close(fd);
  job.join();
  EXPECT_EQ(got, sum_of_squares(600));
  EXPECT_EQ(runner.stats().producers[0].items, 600u);  // the node worked every item, once
}

TEST(NodesHostile, AMessageThatFailsToDeserializeClosesOnlyItsConnection) {
  node_process a{"cpu,cpu"};
  // A coordinator connected before, and using the node after.
  auto c = troupe::cluster::connect({a.address()});
  troupe::unordered_runner<remote_squares> runner{c.devices()};
  EXPECT_EQ(runner.run(iota(100)), sum_of_squares(100));
  auto& sys = troupe::detail::network_system({});
  int fd = raw_connect(a.port());
  auto node_actor = basp_handshake_as(fd, sys, fake_node_id(4444, 'f'));
  // A spawn_producer whose config holds a value of a variant type that does not exist.
  troupe::config cfg;
  cfg.set("troupe_test_key", 1);
  troupe::spawn_producer req{"remote_squares", troupe::find_job("remote_squares").signature, "cpu",
                             cfg};
  auto payload =
      serialized(sys, std::vector<caf::strong_actor_ptr>{}, caf::make_message(req, caf::actor{}));
  auto key = payload.find("troupe_test_key");
  ASSERT_NE(key, std::string::npos);
  payload[key + std::strlen("troupe_test_key")] = '\x7f';  // the value's variant type tag
  ASSERT_TRUE(send_all(fd, basp_request(1, 7, node_actor, payload)));
  EXPECT_TRUE(closed_by_peer_within(fd, std::chrono::seconds{5}));
  close(fd);
  ASSERT_TRUE(a.alive());
  // Only that connection was closed: the node still accepts (it sends its handshake) ...
  int probe = raw_connect(a.port());
  EXPECT_EQ(read_exactly(probe, basp::header_size, std::chrono::seconds{5}).size(),
            basp::header_size);
  close(probe);
  // ... and the coordinator connected before goes on.
  EXPECT_EQ(runner.run(iota(200)), sum_of_squares(200));
}

TEST(NodesHostile, MessagesInAStreamCategoryWithOtherContentAreDropped) {
  node_process a{"cpu"};
  auto& sys = troupe::detail::network_system({});
  int fd = raw_connect(a.port());
  auto node_actor = basp_handshake_as(fd, sys, fake_node_id(4545, 's'));
  // The message id's category comes from the peer; actors read stream categories' content as
  // upstream_msg / downstream_msg.
  // An empty message and one with a string, in both stream categories.
  for (auto& content : {caf::message{}, caf::make_message(std::string{"not a stream message"})})
    for (auto category : {caf::message_id::upstream_message_category,
                          caf::message_id::downstream_message_category}) {
      auto payload = serialized(sys, std::vector<caf::strong_actor_ptr>{}, content);
      auto mid = caf::make_message_id(1).with_category(category).integer_value();
      ASSERT_TRUE(
          send_all(fd, basp_header(basp::message_type::direct_message, 0,
                                   static_cast<std::uint32_t>(payload.size()), mid, 7, node_actor) +
                           payload));
    }
  std::this_thread::sleep_for(std::chrono::milliseconds{300});
  close(fd);
  ASSERT_TRUE(a.alive());
  expect_serves(a.address());
}

TEST(NodesHostile, IdleConnectionsAreClosedAndNeverLockCoordinatorsOut) {
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  if (files.rlim_cur < 1200 && files.rlim_max >= 1200) {
    files.rlim_cur = std::min<rlim_t>(files.rlim_max, 4096);
    setrlimit(RLIMIT_NOFILE, &files);
  }
  const auto deadline = std::chrono::milliseconds{3000};
  node_process a{"cpu", {"--handshake-timeout-ms", std::to_string(deadline.count())}};
  std::vector<int> idle;
  for (int i = 0; i < 1000; ++i) idle.push_back(raw_connect(a.port()));
  // While they are open (the node closes the oldest of them beyond its connection limit):
  expect_serves(a.address());
  // All closed by the node after the handshake deadline (they never sent a byte).
  std::size_t closed = 0;
  auto until = std::chrono::steady_clock::now() + deadline + std::chrono::seconds{10};
  for (int fd : idle) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    if (closed_by_peer_within(fd, std::max(left, std::chrono::milliseconds{0}))) ++closed;
    close(fd);
  }
  EXPECT_EQ(closed, idle.size());
  ASSERT_TRUE(a.alive());
  expect_serves(a.address());
}
