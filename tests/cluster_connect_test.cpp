// A live cluster's connect and reconnector: starting with the nodes that answer, members that
// never answer, two spellings of one address, min_nodes.
#include "cluster_parts.hpp"

TEST(Cluster, ALiveConnectStartsWithTheNodesThatAnswerAndTheOthersJoinWhenTheyDo) {
  // 4 nodes up, one frozen (SIGSTOP), one address with nothing listening; min_nodes 4: connect
  // returns with the 4 within connect_timeout (+ 2 s), the others are members not yet up; a
  // node started on the silent address and the frozen one thawed join the running job by
  // themselves. With min_nodes 6 the same connect throws.
  std::vector<std::unique_ptr<node_process>> up;
  for (int i = 0; i < 4; ++i) up.push_back(std::make_unique<node_process>("cpu"));
  node_process frozen{"cpu"};
  frozen.kill(SIGSTOP);
  auto silent = test_util::free_loopback_address();
  std::vector<std::string> addresses;
  for (auto& n : up) addresses.push_back(n->address());
  addresses.push_back(frozen.address());
  addresses.push_back(silent);
  recorder ev;
  troupe::cluster_options o;
  o.on_change = ev.callback();
  o.connect_timeout = std::chrono::milliseconds{3000};  // 4 healthy nodes, on a loaded machine
  o.reconnect_every = std::chrono::milliseconds{200};
  o.min_nodes = 6;
  {
    test_util::watchdog dog{std::chrono::seconds{30}, "a connect short of min_nodes"};
    EXPECT_THROW(troupe::cluster::connect(addresses, {}, o), troupe::node_error);
  }
  o.min_nodes = 4;
  auto t0 = std::chrono::steady_clock::now();
  std::optional<troupe::cluster> c;
  {
    test_util::watchdog dog{std::chrono::seconds{30}, "a live connect with nodes down"};
    c.emplace(troupe::cluster::connect(addresses, {}, o));
  }
  auto took = std::chrono::steady_clock::now() - t0;
  std::cout << "connect of 6 (1 frozen, 1 silent): "
            << std::chrono::duration<double, std::milli>(took).count() << " ms\n";
  EXPECT_LT(took, o.connect_timeout + std::chrono::seconds{2});
  EXPECT_EQ(c->devices().size(), 4u);
  auto ms = c->members();
  ASSERT_EQ(ms.size(), 6u);
  std::size_t not_up = 0;
  for (auto& m : ms)
    if (m.what == troupe::member::state::lost && m.incarnation == 0) ++not_up;
  EXPECT_EQ(not_up, 2u);
  running_job r{*c, 50};
  node_process late{"cpu", {}, silent};  // the silent address comes up
  frozen.kill(SIGCONT);
  ev.wait_for(troupe::membership_event::joined, silent);
  ev.wait_for(troupe::membership_event::joined, frozen.address());
  {
    test_util::watchdog dog{std::chrono::seconds{60}, "the late nodes' first items"};
    while (items_on(r.runner.stats(), silent) == 0 ||
           items_on(r.runner.stats(), frozen.address()) == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds{2});
  }
  r.finish();
  EXPECT_EQ(c->devices().size(), 6u);
  EXPECT_EQ(ev.count(troupe::membership_event::lost, silent), 0u);
}

/// An address that accepts connections (the kernel does) and never says a word, counting the
/// connections open to it now: a node whose process hangs, or a port a firewall black-holes.
class silent_address {
 public:
  /// On `port` (0: any free one).
  explicit silent_address(std::uint16_t port = 0)
      : port_(port), listener_(wire_attack::raw_listen(port_)), thread_([this] { run(); }) {}
  ~silent_address() {
    stop_ = true;
    thread_.join();
    for (int fd : open_) close(fd);
    close(listener_);
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  std::size_t open() const { return count_.load(); }
  std::size_t accepted() const { return accepted_.load(); }

 private:
  void run() {
    while (!stop_) {
      std::vector<pollfd> fds{{listener_, POLLIN, 0}};
      for (int fd : open_) fds.push_back({fd, POLLIN, 0});
      if (poll(fds.data(), fds.size(), 20) <= 0) continue;
      if (fds[0].revents & POLLIN) {
        int fd = accept(listener_, nullptr, nullptr);
        if (fd >= 0) {
          open_.push_back(fd);
          accepted_ += 1;
        }
      }
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        char buf[4096];
        if (::recv(fds[i].fd, buf, sizeof buf, MSG_DONTWAIT) > 0) continue;  // read, unanswered
        close(fds[i].fd);
        open_.erase(std::find(open_.begin(), open_.end(), fds[i].fd));
      }
      count_ = open_.size();
    }
  }
  std::uint16_t port_ = 0;
  int listener_;
  std::vector<int> open_;
  std::atomic<std::size_t> count_{0}, accepted_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

TEST(Cluster, ARestartedNodeRejoinsWhileTheReconnectorStillWaitsOnSilentMembers) {
  // Four members that never answer (given to connect, started with the one that does), then
  // that one killed and restarted on its address. The reconnector tried lost members one after
  // the other, each until connect_timeout: the restarted node, last in the list, waited behind
  // the silent four (10.6 s with 8 of them, against 1.2 s with none). Now they are tried at
  // once: the restarted node rejoins while the reconnector's connections to the silent ones are
  // still open, waiting for their answers.
  std::vector<std::unique_ptr<silent_address>> silent;
  for (int i = 0; i < 4; ++i) silent.push_back(std::make_unique<silent_address>());
  auto address = test_util::free_loopback_address();
  std::optional<node_process> a;
  a.emplace("cpu", std::vector<std::string>{}, address);
  std::vector<std::string> addresses;
  for (auto& q : silent) addresses.push_back(q->address());
  addresses.push_back(address);
  recorder ev;
  troupe::cluster_options o;
  o.on_change = ev.callback();
  o.min_nodes = 1;
  // Long enough that the silent attempts are still open when a loaded machine's restarted node
  // has answered; tried one after the other they would take 20 s.
  o.connect_timeout = std::chrono::milliseconds{5000};
  o.reconnect_every = std::chrono::milliseconds{100};
  auto c = troupe::cluster::connect(addresses, {}, o);
  ASSERT_EQ(c.devices().size(), 1u);
  a->kill(SIGKILL);
  ev.wait_for(troupe::membership_event::lost, address);
  {
    test_util::watchdog dog{std::chrono::seconds{30}, "the killed node's end"};
    while (!a->ended()) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
  a.reset();
  // The reconnector keeps trying the silent four meanwhile: wait until it is mid-attempt.
  {
    test_util::watchdog dog{std::chrono::seconds{30}, "the reconnector's attempts"};
    while (std::none_of(silent.begin(), silent.end(), [](auto& q) { return q->open() > 0; }))
      std::this_thread::sleep_for(std::chrono::milliseconds{1});
  }
  a.emplace("cpu", std::vector<std::string>{}, address);
  std::atomic<std::size_t> open_at_rejoin{0};
  auto seen = ev.count(troupe::membership_event::rejoined, address);
  std::thread watch{[&] {
    // The silent connections open at the moment the rejoin is reported.
    while (ev.count(troupe::membership_event::rejoined, address) == seen)
      open_at_rejoin =
          silent[0]->open() + silent[1]->open() + silent[2]->open() + silent[3]->open();
  }};
  ev.wait_for(troupe::membership_event::rejoined, address);
  watch.join();
  std::size_t accepted = 0;
  for (auto& q : silent) accepted += q->accepted();
  std::cout << "rejoined with " << open_at_rejoin << " of the silent members' connections open ("
            << accepted << " accepted so far)\n";
  // One after the other, at most the last silent member's connection was still open (1 in
  // two runs of the previous reconnector); at once, all four are.
  EXPECT_GE(open_at_rejoin.load(), 3u)
      << "the restarted node was tried only after the silent members' attempts had ended";
  EXPECT_EQ(c.devices().size(), 1u);
}

TEST(Cluster, AClusterClosedWhileItsReconnectorWaitsOnASilentAddressDoesNotWaitForIt) {
  // A member lost, then its address held by a process that accepts and never answers (a node
  // frozen as it restarts). The reconnector's attempt waits for its answer up to connect_timeout
  // (a minute here), CAF's handshake up to limits::handshake_timeout (10 s). The cluster's last
  // copy waited for that attempt to end (an attack saw a coordinator exit 3 s after its job);
  // now the attempt is given up at once: its connection is still open after the cluster is gone.
  auto address = test_util::free_loopback_address();
  auto port = static_cast<std::uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
  std::optional<node_process> a;
  a.emplace("cpu", std::vector<std::string>{}, address);
  recorder ev;
  troupe::cluster_options o;
  o.on_change = ev.callback();
  o.connect_timeout = std::chrono::seconds{60};
  o.reconnect_every = std::chrono::milliseconds{100};
  std::optional<troupe::cluster> c{troupe::cluster::connect({address}, {}, o)};
  ASSERT_EQ(c->devices().size(), 1u);
  a->kill(SIGKILL);
  ev.wait_for(troupe::membership_event::lost, address);
  {
    test_util::watchdog dog{std::chrono::seconds{30}, "the killed node's end"};
    while (!a->ended()) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
  a.reset();
  silent_address silent{port};
  {
    test_util::watchdog dog{std::chrono::seconds{30}, "the reconnector's attempt"};
    while (silent.open() == 0) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  }
  {
    test_util::watchdog dog{std::chrono::seconds{30}, "the cluster's close"};
    c.reset();
  }
  // The silent address sees a connection close within its poll (20 ms).
  std::this_thread::sleep_for(std::chrono::milliseconds{200});
  EXPECT_EQ(silent.open(), 1u)
      << "the cluster's close waited until CAF gave up on the reconnector's attempt";
  EXPECT_EQ(silent.accepted(), 1u);
}

TEST(Cluster, TwoSpellingsOfOneNodesAddressAreOneMember) {
  // 127.0.0.1:P and 127.1:P (or a name and the address discovery lists) are one node process:
  // they were two members, and every runner that follows the cluster started its producers on
  // that node twice.
  node_process a{"cpu"};
  auto port = a.address().substr(a.address().rfind(':') + 1);
  auto other = "127.1:" + port;
  // A live connect keeps the first spelling (the other is logged); a plain one refuses the
  // second as it refuses an address given twice.
  EXPECT_THROW(troupe::cluster::connect({a.address(), other}), troupe::invalid_argument);
  auto c = troupe::cluster::connect({a.address(), other}, {}, troupe::cluster_options{});
  EXPECT_EQ(c.nodes(), std::vector<std::string>{a.address()});
  EXPECT_EQ(c.devices().size(), 1u);
  try {
    c.add(other);
    ADD_FAILURE() << "added the same node again";
  } catch (const troupe::invalid_argument& e) {
    EXPECT_NE(std::string{e.what()}.find("it is the node " + a.address()), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(c.devices().size(), 1u);
}

TEST(Cluster, MinNodesAboveTheAddressesGivenIsANodeErrorNotACrash) {
  // Every address answers, but there are fewer than min_nodes (a name resolving to 2 pods with
  // --min-nodes 3): connect threw no error of a node (there was none) but rethrew a null
  // exception_ptr, which ended the process.
  node_process a{"cpu"};
  troupe::cluster_options o;
  o.min_nodes = 3;
  test_util::watchdog dog{std::chrono::seconds{30}, "a connect of fewer nodes than min_nodes"};
  try {
    troupe::cluster::connect({a.address()}, {}, o);
    ADD_FAILURE() << "connect returned with 1 node for min_nodes 3";
  } catch (const troupe::node_error& e) {
    EXPECT_NE(std::string{e.what()}.find("1 of 1 nodes answered, min_nodes is 3"),
              std::string::npos)
        << e.what();
  }
}
