// troupe::metrics_text and serve_metrics (docs/api.md, "Watching it run"): the numbers of the
// process's runners in the Prometheus text format, with bounded series (no job in a label),
// accepted by promtool, served over HTTP.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <troupe/detail/network.hpp>
#include <troupe/metrics.hpp>
#include <troupe/protocol.hpp>

#include "remote_jobs.hpp"
#include "test_jobs.hpp"
#include "test_util.hpp"

namespace {

/// The value of the sample `name{labels}` (the exact line prefix), or -1.
double sample(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  return -1;
}

/// The series (sample lines without their values) of a text.
std::set<std::string> series_of(const std::string& text) {
  std::set<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty() && line[0] != '#') out.insert(line.substr(0, line.rfind(' ')));
  return out;
}

std::string runner_label(const std::string& text) {
  // The newest runner is the one with the largest id among the troupe_runners' samples.
  std::regex re("troupe_jobs_submitted_total\\{runner=\"([0-9]+)\"\\}");
  std::string last;
  for (std::sregex_iterator i(text.begin(), text.end(), re), e; i != e; ++i) last = (*i)[1];
  return last;
}

TEST(Metrics, TheTextHasTheRunnersNumbersAndItsSeriesDoNotGrowWithTheJobs) {
  troupe::unordered_runner<test_jobs::squares> runner{2};
  EXPECT_EQ(runner.run(test_util::iota(1000)), test_util::sum_of_squares(1000));
  auto text = troupe::metrics_text();
  auto id = runner_label(text);
  ASSERT_FALSE(id.empty()) << text;
  auto r = "{runner=\"" + id + "\"}";
  EXPECT_EQ(sample(text, "troupe_items_consumed_total" + r), 1000) << text;
  EXPECT_EQ(sample(text, "troupe_jobs_submitted_total" + r), 1);
  EXPECT_EQ(
      sample(text, "troupe_jobs_completed_total{outcome=\"succeeded\",runner=\"" + id + "\"}"), 1);
  EXPECT_EQ(sample(text, "troupe_jobs_running" + r), 0);
  EXPECT_EQ(sample(text, "troupe_queued_items" + r), 0);
  EXPECT_EQ(sample(text, "troupe_producers{runner=\"" + id + "\",state=\"up\"}"), 2);
  auto items0 = sample(
      text, "troupe_producer_items_total{device=\"cpu\",producer=\"0\",runner=\"" + id + "\"}");
  auto items1 = sample(
      text, "troupe_producer_items_total{device=\"cpu\",producer=\"1\",runner=\"" + id + "\"}");
  EXPECT_EQ(items0 + items1, 1000);
  EXPECT_NE(text.find("# TYPE troupe_producer_busy_seconds_total counter"), std::string::npos);
  EXPECT_EQ(sample(text, "troupe_build_info{version=\"0.1.0\"}"), 1);
  EXPECT_GT(sample(text, "process_resident_memory_bytes"), 0);
  EXPECT_GT(sample(text, "process_open_fds"), 0);
  // 1,000 more jobs: more in the counters, not one more series.
  for (int i = 0; i < 1000; ++i) runner.run(test_util::iota(3));
  auto after = troupe::metrics_text();
  EXPECT_EQ(series_of(after), series_of(text)) << "a label took a job";
  EXPECT_EQ(sample(after, "troupe_jobs_submitted_total" + r), 1001);
  EXPECT_EQ(sample(after, "troupe_items_consumed_total" + r), 4000);
  // Histograms: one job-time observation per job ended, one chunk-time observation per chunk.
  EXPECT_EQ(sample(after, "troupe_job_seconds_count" + r), 1001);
  EXPECT_EQ(sample(after, "troupe_job_seconds_bucket{runner=\"" + id + "\",le=\"+Inf\"}"), 1001);
  EXPECT_GE(sample(after, "troupe_chunk_seconds_count" + r), 1001);
  // Queue wait: one observation per chunk's first send; every answer was sent before.
  auto first = sample(after, "troupe_chunks_sent_total{attempt=\"first\",runner=\"" + id + "\"}");
  auto again = sample(after, "troupe_chunks_sent_total{attempt=\"again\",runner=\"" + id + "\"}");
  EXPECT_GE(first, 1001);
  EXPECT_GE(again, 0);
  EXPECT_EQ(sample(after, "troupe_queue_wait_seconds_count" + r), first);
  EXPECT_GE(first + again, sample(after, "troupe_chunk_seconds_count" + r));
  EXPECT_GT(sample(after, "troupe_last_item_timestamp_seconds" + r), 1.7e9);  // a unix time
  EXPECT_EQ(sample(after, "troupe_late_answers_total" + r), 0);
  // Every name: troupe_ or process_, and counters end in _total.
  for (auto& s : series_of(after)) {
    auto name = s.substr(0, s.find('{'));
    EXPECT_TRUE(name.rfind("troupe_", 0) == 0 || name.rfind("process_", 0) == 0) << name;
  }
}

/// promtool's complaints about `text` ("" when it accepts it), or a skip reason.
std::string promtool_says(const std::string& text, int& rc) {
#ifdef TROUPE_PROMTOOL
  auto path = ::testing::TempDir() + "troupe_metrics.txt";
  {
    std::ofstream out(path);
    out << text;
  }
  auto cmd = std::string{TROUPE_PROMTOOL} + " check metrics < " + path + " 2>&1";
  std::string said;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return "popen failed";
  char buf[512];
  while (auto n = fread(buf, 1, sizeof buf, p)) said.append(buf, n);
  rc = pclose(p);
  return said;
#else
  (void)text;
  rc = 0;
  return {};
#endif
}

TEST(Metrics, PromtoolAcceptsTheText) {
#ifndef TROUPE_PROMTOOL
  GTEST_SKIP() << "promtool was not found when this was configured (tools/setup.sh unpacks "
                  "Debian's prometheus package's promtool into /opt/troupe-promtool)";
#else
  troupe::unordered_runner<test_jobs::squares> runner{2};
  runner.run(test_util::iota(100));
  int rc = -1;
  auto said = promtool_says(troupe::metrics_text(), rc);
  EXPECT_EQ(rc, 0) << said;
  EXPECT_EQ(said, "") << "promtool's lint complained";
#endif
}

/// The port a metrics server listens on.
int port_of(const troupe::metrics_server& s) {
  auto addr = s.address();
  return std::stoi(addr.substr(addr.rfind(':') + 1));
}

/// A TCP connection to 127.0.0.1:port, or -1.
int connect_loopback(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/// GET `path` from 127.0.0.1:port; the whole answer.
std::string http_get(int port, const std::string& path) {
  int fd = connect_loopback(port);
  if (fd < 0) return {};
  auto req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  close(fd);
  return out;
}

/// Items from 4 on wait for `release` (the job stays running while the test looks).
struct held_squares {
  static inline test_util::latch* release = nullptr;
  struct producer {
    producer(const troupe::device&, const troupe::config&) {}
    std::int64_t work(std::int64_t x) {
      if (x >= 4) release->wait();
      return x * x;
    }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

TEST(Metrics, RetriesAndSkippedItemsAgreeWithTheJobsReports) {
  troupe::unordered_runner<test_jobs::throws_on_item> runner{2};
  troupe::job_options o;
  o.on_error = troupe::error_policy::retry(2).then_skip();
  auto h = runner.submit(test_util::iota(100), o);
  h.get();
  auto report = h.report();
  ASSERT_EQ(report.failures.size(), 1u) << "item 42 fails every attempt";
  auto text = troupe::metrics_text();
  auto r = "{runner=\"" + runner_label(text) + "\"}";
  EXPECT_EQ(sample(text, "troupe_retries_total" + r), static_cast<double>(report.retries));
  EXPECT_EQ(report.retries, 2u);
  EXPECT_EQ(sample(text, "troupe_skipped_items_total" + r), 1);
}

/// One producer taking one item at a time, held on item 4 until `release` opens.
struct held_runner {
  test_util::latch release;
  troupe::unordered_runner<held_squares> runner{1, {}, one_item_chunks()};
  held_runner() { held_squares::release = &release; }
  static troupe::options one_item_chunks() {
    troupe::options o;
    o.chunk_size = 1;
    return o;
  }
};

TEST(Metrics, ScrapedDuringARunPromtoolAcceptsItAndAfterItTheCountersAreTheRunnersStats) {
  held_runner held;
  auto& runner = held.runner;
  auto h = runner.submit(test_util::iota(10));
  // During: a job is running (item 4 held), and the text is valid.
  while (runner.stats().items < 4) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  auto during = troupe::metrics_text();
  EXPECT_FALSE(h.done());
  auto id = runner_label(during);
  ASSERT_FALSE(id.empty()) << during;
  auto r = "{runner=\"" + id + "\"}";
  EXPECT_EQ(sample(during, "troupe_jobs_running" + r), 1);
  int rc = -1;
  auto said = promtool_says(during, rc);
  EXPECT_EQ(rc, 0) << said;
  EXPECT_EQ(said, "") << "promtool's lint complained about a text taken during a run";
  held.release.open();
  EXPECT_EQ(h.get(), test_util::sum_of_squares(10));
  // After: each counter is what stats() says.
  auto after = troupe::metrics_text();
  auto s = runner.stats();
  EXPECT_EQ(sample(after, "troupe_items_consumed_total" + r), static_cast<double>(s.items));
  EXPECT_EQ(
      sample(after, "troupe_jobs_completed_total{outcome=\"succeeded\",runner=\"" + id + "\"}"),
      static_cast<double>(s.runs - s.failed_runs));
  EXPECT_EQ(sample(after, "troupe_duplicated_items_total" + r),
            static_cast<double>(s.duplicated_items));
  EXPECT_EQ(sample(after, "troupe_late_answers_total" + r), static_cast<double>(s.late_answers));
  ASSERT_EQ(s.producers.size(), 1u);
  EXPECT_EQ(sample(after, "troupe_producer_items_total{device=\"cpu\",producer=\"0\",runner=\"" +
                              id + "\"}"),
            static_cast<double>(s.producers[0].items));
  EXPECT_EQ(sample(after, "troupe_jobs_running" + r), 0);
  said = promtool_says(after, rc);
  EXPECT_EQ(rc, 0) << said;
  EXPECT_EQ(said, "");
}

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
