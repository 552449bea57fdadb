// The floor under a coordinator's CPU per remote chunk: a plain TCP client, written the way a
// C programmer writes one (one thread, epoll, non-blocking sockets, no allocation per message),
// that keeps N server processes busy with requests, as troupe's coordinator keeps N nodes busy
// with chunks. Each server (a child process, blocking socket) reads a request, sleeps WORK_US
// (its "chunk": the nodes of bench/many_nodes.sh sleep 8 x 2 ms), and writes an answer of the
// same size; the client sends the next request to that server as soon as its answer is read.
// Prints the client's CPU (getrusage: user + system) per round trip. One request and one
// answer per chunk is what troupe sends too, so this is what any design with one message each
// way costs the coordinator on this machine (BENCHMARKS.md, "The floor under a node chunk").
//
//   build/bench/troupe_echo_floor --servers 128 --round-trips 8000 --work-us 16000 --bytes 128
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <vector>

#include "process_clocks.hpp"

namespace {

bool full(int fd, char* p, std::size_t n, bool reading) {
  while (n > 0) {
    auto k = reading ? ::read(fd, p, n) : ::write(fd, p, n);
    if (k <= 0) return false;
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

/// A server: accepts one connection, answers each request after work_us.
[[noreturn]] void serve(int listener, long work_us, std::size_t bytes) {
  int fd = ::accept(listener, nullptr, nullptr);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  std::vector<char> buf(bytes);
  timespec work{work_us / 1'000'000, (work_us % 1'000'000) * 1000};
  while (full(fd, buf.data(), bytes, true)) {
    nanosleep(&work, nullptr);
    if (!full(fd, buf.data(), bytes, false)) break;
  }
  _exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe_echo_floor: a plain epoll TCP client's CPU per round trip"};
  int servers = 128;
  long round_trips = 8000, work_us = 16000;
  std::size_t bytes = 128;
  app.add_option("--servers", servers, "server processes");
  app.add_option("--round-trips", round_trips, "round trips in all");
  app.add_option("--work-us", work_us, "each server's sleep per request");
  app.add_option("--bytes", bytes, "request and answer size");
  CLI11_PARSE(app, argc, argv);

  std::vector<pid_t> children;
  std::vector<int> fds;
  for (int i = 0; i < servers; ++i) {
    int l = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(l, 1) != 0) {
      std::perror("bind/listen");
      return 1;
    }
    socklen_t len = sizeof a;
    ::getsockname(l, reinterpret_cast<sockaddr*>(&a), &len);
    pid_t pid = ::fork();
    if (pid == 0) serve(l, work_us, bytes);
    children.push_back(pid);
    ::close(l);
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno != EINPROGRESS) {
      std::perror("connect");
      return 1;
    }
    fds.push_back(fd);
  }
  int ep = ::epoll_create1(0);
  for (int i = 0; i < servers; ++i) {
    epoll_event e{};
    e.events = EPOLLIN;
    e.data.u32 = static_cast<std::uint32_t>(i);
    ::epoll_ctl(ep, EPOLL_CTL_ADD, fds[static_cast<std::size_t>(i)], &e);
  }
  std::vector<char> buf(bytes, 'x');
  std::vector<std::size_t> got(static_cast<std::size_t>(servers), 0);
  auto send_one = [&](int i) {
    // Small and the socket's buffer is empty: one write() takes it whole on loopback.
    return ::write(fds[static_cast<std::size_t>(i)], buf.data(), bytes) ==
           static_cast<ssize_t>(bytes);
  };
  ::usleep(200'000);  // the children have accepted
  double cpu0 = cpu_seconds(), t0 = now_seconds();
  long sent = 0, done = 0;
  for (int i = 0; i < servers && sent < round_trips; ++i, ++sent)
    if (!send_one(i)) return 1;
  std::vector<epoll_event> events(static_cast<std::size_t>(servers));
  while (done < round_trips) {
    int n = ::epoll_wait(ep, events.data(), servers, -1);
    for (int k = 0; k < n; ++k) {
      auto i = static_cast<int>(events[static_cast<std::size_t>(k)].data.u32);
      auto& have = got[static_cast<std::size_t>(i)];
      auto r = ::read(fds[static_cast<std::size_t>(i)], buf.data(), bytes - have);
      if (r <= 0) continue;
      have += static_cast<std::size_t>(r);
      if (have < bytes) continue;
      have = 0;
      ++done;
      if (sent < round_trips) {
        if (!send_one(i)) return 1;
        ++sent;
      }
    }
  }
  double cpu = cpu_seconds() - cpu0, wall = now_seconds() - t0;
  for (auto fd : fds) ::close(fd);
  for (auto pid : children) ::waitpid(pid, nullptr, 0);
  std::printf(
      "%d servers, %ld round trips of %zu bytes, %ld us of work each: %.2f s, client CPU %.3f s "
      "= %.1f us per round trip\n",
      servers, round_trips, bytes, work_us, wall, cpu, cpu / static_cast<double>(done) * 1e6);
  return 0;
}
