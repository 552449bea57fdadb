// The helpers of the metrics tests (metrics*_test.cpp): samples read from the text, promtool,
// HTTP GETs to a metrics server, and a runner held mid-job.
#pragma once

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
inline double sample(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  return -1;
}

/// The series (sample lines without their values) of a text.
inline std::set<std::string> series_of(const std::string& text) {
  std::set<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty() && line[0] != '#') out.insert(line.substr(0, line.rfind(' ')));
  return out;
}

inline std::string runner_label(const std::string& text) {
  // The newest runner is the one with the largest id among the troupe_runners' samples.
  std::regex re("troupe_jobs_submitted_total\\{runner=\"([0-9]+)\"\\}");
  std::string last;
  for (std::sregex_iterator i(text.begin(), text.end(), re), e; i != e; ++i) last = (*i)[1];
  return last;
}

/// promtool's complaints about `text` ("" when it accepts it), or a skip reason.
inline std::string promtool_says(const std::string& text, int& rc) {
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

/// The port a metrics server listens on.
inline int port_of(const troupe::metrics_server& s) {
  auto addr = s.address();
  return std::stoi(addr.substr(addr.rfind(':') + 1));
}

/// A TCP connection to 127.0.0.1:port, or -1.
inline int connect_loopback(int port) {
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
inline std::string http_get(int port, const std::string& path) {
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

}  // namespace
