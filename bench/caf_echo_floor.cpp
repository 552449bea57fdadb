// The floor CAF's network layer puts under a coordinator's CPU per remote chunk: the plain
// epoll client of echo_floor.cpp, written the way a CAF user writes it. N server processes
// each publish an actor (detached, as troupe's producers are) that sleeps WORK_US per request
// and answers with the request's bytes; one client actor keeps every server busy with
// request(...).then(...), sending the next request to a server as soon as its answer arrives.
// Prints the client process's CPU (getrusage: user + system, every CAF thread) per round trip.
// One message each way is what a troupe chunk costs at the least, so this is what any design
// on CAF's BASP pays per chunk before troupe's own work (BENCHMARKS.md).
//
//   build/bench/troupe_caf_echo_floor --servers 16 --round-trips 4000 --work-us 16000
//   build/bench/troupe_caf_echo_floor ... --troupe-config   (troupe's CAF settings, network.cpp)
//   build/bench/troupe_caf_echo_floor ... --troupe-config --detached-client --consumer
// The last is the shape of troupe's coordinator: the client on a thread of its own (as troupe's
// scheduler) and each answer passed on to a second actor that does nothing with it (as the job's
// consumer), one more message per round trip.
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <caf/all.hpp>
#include <caf/io/all.hpp>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "process_clocks.hpp"

namespace {

void configure(caf::actor_system_config& cfg, bool troupe_config) {
  cfg.load<caf::io::middleman>();
  cfg.set("logger.file-verbosity", caf::atom("quiet"));
  cfg.set("logger.console-verbosity", caf::atom("quiet"));
  if (!troupe_config) return;
  // What nodes/src/network.cpp sets for troupe's own actor systems.
  cfg.set("scheduler.policy", caf::atom("sharing"));
  cfg.set("scheduler.max-threads", std::size_t{2});
  cfg.set("middleman.workers", std::size_t{0});
  cfg.set("scheduler.max-throughput", std::size_t{1});
}

/// A server process: publishes a detached echo actor on a free port, writes the port to `out`,
/// and serves until the parent closes its end of stdin (then exits at once: nothing to keep).
[[noreturn]] void serve(int out, long work_us, bool troupe_config) {
  caf::actor_system_config cfg;
  configure(cfg, troupe_config);
  caf::actor_system sys{cfg};
  auto echo = sys.spawn<caf::detached>([work_us]() -> caf::behavior {
    return {[work_us](const std::string& s) {
      std::this_thread::sleep_for(std::chrono::microseconds(work_us));
      return s;
    }};
  });
  auto port = sys.middleman().publish(echo, 0, "127.0.0.1");
  std::uint16_t p = port ? *port : 0;
  if (::write(out, &p, sizeof p) != sizeof p || !port) _exit(1);
  ::close(out);
  char c;
  while (::read(STDIN_FILENO, &c, 1) > 0) {
  }
  _exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe_caf_echo_floor: a CAF client actor's CPU per remote round trip"};
  int servers = 16;
  long round_trips = 4000, work_us = 16000;
  std::size_t bytes = 128;
  bool troupe_config = false, detached_client = false, consumer = false;
  app.add_option("--servers", servers, "server processes");
  app.add_option("--round-trips", round_trips, "round trips in all");
  app.add_option("--work-us", work_us, "each server's sleep per request");
  app.add_option("--bytes", bytes, "request and answer size");
  app.add_flag("--troupe-config", troupe_config, "troupe's CAF settings (network.cpp)");
  app.add_flag("--detached-client", detached_client, "the client on a thread of its own");
  app.add_flag("--consumer", consumer, "each answer sent on to a second actor");
  CLI11_PARSE(app, argc, argv);

  // The servers are forked before this process starts an actor system of its own.
  int hold[2];
  if (::pipe(hold) != 0) return 1;
  std::vector<pid_t> children;
  std::vector<std::uint16_t> ports;
  for (int i = 0; i < servers; ++i) {
    int p[2];
    if (::pipe(p) != 0) return 1;
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(p[0]);
      ::close(hold[1]);
      ::dup2(hold[0], STDIN_FILENO);
      serve(p[1], work_us, troupe_config);
    }
    ::close(p[1]);
    std::uint16_t port = 0;
    if (::read(p[0], &port, sizeof port) != sizeof port || port == 0) {
      std::fprintf(stderr, "server %d did not publish\n", i);
      return 1;
    }
    ::close(p[0]);
    children.push_back(pid);
    ports.push_back(port);
  }
  ::close(hold[0]);

  double cpu = 0, wall = 0;
  long done = 0;
  {
    caf::actor_system_config cfg;
    configure(cfg, troupe_config);
    caf::actor_system sys{cfg};
    std::vector<caf::actor> remotes;
    for (auto port : ports) {
      auto a = sys.middleman().remote_actor("127.0.0.1", port);
      if (!a) {
        std::fprintf(stderr, "connect: %s\n", sys.render(a.error()).c_str());
        return 1;
      }
      remotes.push_back(*a);
    }
    auto sink = sys.spawn([]() -> caf::behavior { return {[](const std::string&) {}}; });
    double cpu0 = cpu_seconds(), t0 = now_seconds();
    auto body = [&, payload = std::string(bytes, 'x')](caf::event_based_actor* self) {
      auto sent = std::make_shared<long>(0);
      auto next = std::make_shared<std::function<void(std::size_t)>>();
      *next = [=, &done](std::size_t i) {
        ++*sent;
        self->request(remotes[i], caf::infinite, payload)
            .then([=, &done](const std::string& answer) {
              if (consumer) self->send(sink, answer);
              if (++done == round_trips)
                self->quit();
              else if (*sent < round_trips)
                (*next)(i);
            });
      };
      for (std::size_t i = 0; i < remotes.size() && *sent < round_trips; ++i) (*next)(i);
    };
    auto client = detached_client ? sys.spawn<caf::detached>(body) : sys.spawn(body);
    caf::scoped_actor {
      sys
      } -> wait_for(client);
    cpu = cpu_seconds() - cpu0;
    wall = now_seconds() - t0;
    caf::anon_send_exit(sink, caf::exit_reason::user_shutdown);
  }
  ::close(hold[1]);
  for (auto pid : children) ::waitpid(pid, nullptr, 0);
  std::printf(
      "%d servers, %ld round trips of %zu bytes, %ld us of work each%s%s%s: %.2f s, client "
      "CPU %.3f s = %.1f us per round trip\n",
      servers, done, bytes, work_us, troupe_config ? ", troupe's CAF settings" : "",
      detached_client ? ", detached client" : "", consumer ? ", a consumer" : "", wall, cpu,
      cpu / static_cast<double>(done) * 1e6);
  return 0;
}
