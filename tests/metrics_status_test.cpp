// troupe::metrics_text and serve_metrics, continued: /status.json's running jobs, a node's own
// numbers, bulk watch requests, the live page, and scrapes beside idle connections.
#include "metrics_parts.hpp"

namespace {

TEST(Metrics, StatusJsonListsRunningJobsWithTheirProgressAndForgetsEndedOnes) {
  held_runner held;
  auto& runner = held.runner;
  auto h = runner.submit(test_util::iota(10));
  // Items 0..3 reach the consumer while 4 is held (progress is published at most every
  // 100 ms: done is at most 4 of 10 meanwhile).
  std::regex running(
      "\"jobs\":\\[\\{\"id\":1"  // the runner's first job
      ",\"done\":[0-4],\"total\":10,\"items_per_second\":");
  auto status = troupe::status_json();
  EXPECT_TRUE(std::regex_search(status, running)) << status;
  EXPECT_FALSE(h.done()) << "listed while it runs";
  held.release.open();
  EXPECT_EQ(h.get(), 285);
  // Ended: no longer listed, though its handle is kept.
  EXPECT_NE(troupe::status_json().find("\"jobs\":[]"), std::string::npos) << troupe::status_json();
  // Many ended jobs with their handles kept: none listed.
  std::vector<decltype(h)> kept;
  for (int i = 0; i < 300; ++i) kept.push_back(runner.submit(test_util::iota(3)));
  for (auto& k : kept) EXPECT_EQ(k.get(), 5);
  EXPECT_NE(troupe::status_json().find("\"jobs\":[]"), std::string::npos);
}

TEST(Metrics, StatusJsonListsTheOldestThirtyTwoRunningJobs) {
  // 40 running jobs (the first holds the only producer; 300 ended ones before them, handles
  // kept): exactly the 32 oldest running ones are listed, in order.
  held_runner held;
  auto& runner = held.runner;
  std::vector<troupe::job_handle<std::int64_t>> ended, running;
  for (int i = 0; i < 300; ++i) ended.push_back(runner.submit(test_util::iota(3)));
  for (auto& k : ended) EXPECT_EQ(k.get(), 5);
  for (int i = 0; i < 40; ++i) running.push_back(runner.submit(test_util::iota(10)));
  auto status = troupe::status_json();
  std::regex job("\\{\"id\":([0-9]+),\"done\":[0-9]+,\"total\":10,");
  std::vector<int> ids;
  for (std::sregex_iterator i(status.begin(), status.end(), job), e; i != e; ++i)
    ids.push_back(std::stoi((*i)[1]));
  std::vector<int> expected(32);
  std::iota(expected.begin(), expected.end(), 301);  // jobs 301..332 of this runner
  EXPECT_EQ(ids, expected) << status;
  held.release.open();
  for (auto& k : running) EXPECT_EQ(k.get(), 285);
  EXPECT_NE(troupe::status_json().find("\"jobs\":[]"), std::string::npos);
}

TEST(Metrics, ANodeServedByThisProcessHasItsOwnNumbers) {
  // A node in this process, and a runner over its two producers: the node's numbers while the
  // runner lives and after it has gone; a refused request counted; the process's worked items.
  test_util::watchdog dog{std::chrono::seconds{60}, "a node's metrics"};
  auto node = troupe::node::serve("127.0.0.1:0", {"cpu", "cpu"});
  auto at = node.address();
  auto series = [&](const std::string& name) { return name + "{node=\"" + at + "\"}"; };
  auto before_items = sample(troupe::metrics_text(), "troupe_worked_items_total");
  {
    troupe::options opts;
    opts.speculative = false;  // no copies: each item worked once
    // Nor trims: the items a trim takes from a late chunk are sent again (4 items, 32 bytes
    // more, once under a loaded ctest -j 2).
    opts.split_late_chunks = false;
    troupe::unordered_runner<remote_squares> runner{
        {troupe::device{at + "/cpu"}, troupe::device{at + "/cpu"}}, {}, opts};
    EXPECT_EQ(runner.run(test_util::iota(1000)), test_util::sum_of_squares(1000));
    auto text = troupe::metrics_text();
    EXPECT_EQ(sample(text, series("troupe_node_producers")), 2) << text;
    EXPECT_EQ(sample(text, series("troupe_node_coordinators")), 1);
    EXPECT_EQ(sample(text, series("troupe_node_producers_spawned_total")), 2);
    EXPECT_EQ(sample(text, series("troupe_node_spawns_refused_total")), 0);
    EXPECT_EQ(sample(text, series("troupe_node_draining")), 0);
    // Every item was worked by a producer living in this process (the node's).
    EXPECT_EQ(sample(text, "troupe_worked_items_total") - before_items, 1000);
    // 1,000 numbers of 8 bytes went to the node's producers, and 1,000 came back (no copies).
    auto rl = runner_label(text);
    EXPECT_EQ(
        sample(text, "troupe_node_payload_bytes_total{direction=\"sent\",runner=\"" + rl + "\"}"),
        8000);
    EXPECT_EQ(sample(text, "troupe_node_payload_bytes_total{direction=\"received\",runner=\"" + rl +
                               "\"}"),
              8000);
    EXPECT_EQ(sample(text, "troupe_node_chunks_unsized_total{runner=\"" + rl + "\"}"), 0);
    auto status = troupe::status_json();
    EXPECT_NE(status.find("\"nodes\":[{\"address\":\"" + at + "\""), std::string::npos) << status;
  }
  // The runner is gone: its producers end on the node (the node hears it in its own time).
  double left = -1;
  for (int i = 0; i < 5000 && left != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
    left = sample(troupe::metrics_text(), series("troupe_node_producers"));
  }
  EXPECT_EQ(left, 0);
  // A device the node does not offer: refused, and counted.
  EXPECT_THROW((troupe::unordered_runner<remote_squares>{{troupe::device{at + "/cuda:7"}}}),
               troupe::error);
  auto text = troupe::metrics_text();
  EXPECT_EQ(sample(text, series("troupe_node_spawns_refused_total")), 1) << text;
  EXPECT_EQ(sample(text, series("troupe_node_producers_spawned_total")), 2);
  node.stop();
  EXPECT_EQ(troupe::metrics_text().find("troupe_node_producers{"), std::string::npos)
      << "a stopped node is no longer listed";
}

TEST(NodesHostile, WatchRequestsInBulkAreCappedAndWatchersThatEndAreForgotten) {
  // 1,100 actors each ask a node to watch them (as a cluster's listener does), one of them
  // twice: the node keeps at most 1,024 (node_state::max_watchers), counts none twice, and
  // forgets each one that ends. Seen through the node's own metric.
  test_util::watchdog dog{std::chrono::seconds{60}, "watch requests in bulk"};
  auto node = troupe::node::serve("127.0.0.1:0", {"cpu"});
  auto at = node.address();
  auto& sys = troupe::detail::network_system({});
  auto colon = at.rfind(':');
  auto target = sys.middleman().remote_actor(
      at.substr(0, colon), static_cast<std::uint16_t>(std::stoi(at.substr(colon + 1))));
  ASSERT_TRUE(target) << sys.render(target.error());
  auto watchers = [&] {
    return sample(troupe::metrics_text(), "troupe_node_watchers{node=\"" + at + "\"}");
  };
  auto until = [&](double want) {
    double got = -1;
    for (int i = 0; i < 10000 && got != want; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds{1});
      got = watchers();
    }
    return got;
  };
  std::vector<caf::actor> crowd;
  for (int i = 0; i < 1100; ++i) {
    // An argument, however useless: CAF 0.17.6 needs one for a spawn of a function.
    crowd.push_back(sys.spawn(
        [](caf::event_based_actor*, bool) -> caf::behavior {
          return {[](troupe::leaving_atom, std::uint64_t) {}};
        },
        true));
    caf::send_as(crowd.back(), *target, troupe::watch_atom::value);
    // The first one asks twice, before the cap is reached: kept once (were it kept twice, one
    // entry would outlive it below).
    if (i == 0) caf::send_as(crowd.back(), *target, troupe::watch_atom::value);
  }
  // A request after all of them is answered after all of them (one mailbox, in order).
  caf::scoped_actor self{sys};
  self->request(*target, std::chrono::seconds{30}, troupe::hello_atom::value)
      .receive([](const troupe::node_hello&) {},
               [](const caf::error& e) { FAIL() << "no hello: " << to_string(e); });
  EXPECT_EQ(watchers(), 1024);
  // Every one of them ends: the node forgets them all (it monitors each one it keeps).
  for (auto& a : crowd) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
  crowd.clear();
  EXPECT_EQ(until(0), 0);
  // Room again: a new watcher is kept.
  auto late =
      sys.spawn([](caf::event_based_actor*,
                   bool) -> caf::behavior { return {[](troupe::leaving_atom, std::uint64_t) {}}; },
                true);
  caf::send_as(late, *target, troupe::watch_atom::value);
  EXPECT_EQ(until(1), 1);
  caf::anon_send_exit(late, caf::exit_reason::user_shutdown);
}

TEST(Metrics, ServeMetricsAnswersMetricsStatusAndTheLivePage) {
  troupe::unordered_runner<test_jobs::squares> runner{1};
  runner.run(test_util::iota(10));
  auto server = troupe::serve_metrics("127.0.0.1:0");
  auto addr = server.address();
  auto port = port_of(server);
  ASSERT_GT(port, 0) << addr;
  // A client that connects and says nothing holds no one else up.
  int idle = connect_loopback(port);
  ASSERT_GE(idle, 0);
  auto answer = http_get(port, "/metrics");
  EXPECT_NE(answer.find("200 OK"), std::string::npos) << answer.substr(0, 200);
  EXPECT_NE(answer.find("text/plain; version=0.0.4"), std::string::npos);
  EXPECT_NE(answer.find("troupe_build_info"), std::string::npos);
  EXPECT_NE(answer.find("troupe_items_consumed_total"), std::string::npos);
  auto status = http_get(port, "/status.json");
  EXPECT_NE(status.find("application/json"), std::string::npos);
  EXPECT_NE(status.find("\"producers\":[{\"index\":0,\"device\":\"cpu\""), std::string::npos)
      << status;
  auto page = http_get(port, "/");
  EXPECT_NE(page.find("<!doctype html>"), std::string::npos);
  EXPECT_NE(page.find("status.json"), std::string::npos);
  // Self-contained: nothing loaded from elsewhere (it works offline).
  EXPECT_EQ(page.find("http://"), std::string::npos);
  EXPECT_EQ(page.find("https://"), std::string::npos);
  EXPECT_EQ(page.find("src="), std::string::npos);
  EXPECT_NE(http_get(port, "/nothing").find("404"), std::string::npos);
  EXPECT_NE(http_get(port, "/metrics?x=1").find("troupe_build_info"), std::string::npos)
      << "a query string is ignored";
  close(idle);
  EXPECT_THROW(troupe::serve_metrics("nonsense"), troupe::invalid_argument);
  EXPECT_THROW(troupe::serve_metrics(addr), troupe::invalid_argument) << "the port is taken";
}

}  // namespace

namespace {

/// True while the server has not closed `fd` (nothing to read yet, no end of stream).
bool still_open(int fd) {
  char c;
  auto n = recv(fd, &c, 1, MSG_DONTWAIT);
  return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

}  // namespace

TEST(MetricsHostile, ScrapesAreAnsweredWhileManyIdleConnectionsAreHeld) {
  // A thread-per-connection server whose workers all wait on silent clients answers nobody
  // until its read timeout drops them (a slowloris). 64 idle connections (browser tabs left
  // open, a scanner) must not stop a scrape: it is answered while every one of them is still
  // open, so it did not wait for the server to give up on them. And scrapes from 16 threads
  // at once all get the whole text; 300 more silent clients (past the server's 256) cannot
  // lock a scraper out either.
  troupe::unordered_runner<test_jobs::squares> runner{1};
  runner.run(test_util::iota(10));
  auto server = troupe::serve_metrics("127.0.0.1:0");
  auto port = port_of(server);
  std::vector<int> idle;
  for (int i = 0; i < 64; ++i) {
    int fd = connect_loopback(port);
    ASSERT_GE(fd, 0);
    idle.push_back(fd);
  }
  // Half of them send the start of a request and stop (a slow client).
  for (std::size_t i = 0; i < idle.size(); i += 2) (void)!write(idle[i], "GET /metr", 9);
  auto answer = http_get(port, "/metrics");
  EXPECT_NE(answer.find("troupe_build_info"), std::string::npos) << answer.substr(0, 200);
  std::size_t open = 0;
  for (int fd : idle) open += still_open(fd) ? 1 : 0;
  EXPECT_EQ(open, idle.size()) << "the scrape waited for idle connections to be dropped";
  std::vector<std::thread> scrapers;
  std::atomic<int> whole{0};
  for (int t = 0; t < 16; ++t)
    scrapers.emplace_back([&] {
      for (int k = 0; k < 10; ++k)
        if (http_get(port, "/metrics").find("troupe_items_consumed_total") != std::string::npos &&
            http_get(port, "/status.json").find("\"producers\"") != std::string::npos)
          whole += 1;
    });
  for (auto& t : scrapers) t.join();
  EXPECT_EQ(whole.load(), 160);
  // Past the server's 256 clients, silent ones make room, oldest first: still answered.
  for (int i = 0; i < 300; ++i) {
    int fd = connect_loopback(port);
    ASSERT_GE(fd, 0);
    idle.push_back(fd);
  }
  answer = http_get(port, "/status.json");
  EXPECT_NE(answer.find("\"producers\""), std::string::npos) << answer.substr(0, 200);
  EXPECT_FALSE(still_open(idle.front())) << "the oldest silent client was not the one dropped";
  for (int fd : idle) close(fd);
}
