// A churn soak (BENCHMARKS.md, "Churn soak"): a live cluster of --nodes node processes (this
// program again, as children, on fixed loopback ports), a runner that follows it, and --callers
// threads streaming jobs through it, while every 1-2 s one node, drawn at random, is
//   SIGKILLed and restarted on its address at once (without waiting for the loss), or
//   SIGTERMed (it drains) and restarted, or
//   removed with cluster::remove() and added back with cluster::add(), or
//   frozen (SIGSTOP) for 0.5-3 s (past lost_after sometimes) and thawed.
// Every job's result is checked; a job that takes longer than --hang-s counts as a hang. Every
// --report-s: jobs, wrong results, failures, the longest job and membership call, and the
// coordinator's threads, descriptors, RSS and heap in use (mallinfo2: live allocations, so that
// RSS growth can be told from the allocator's high-water mark). Exit 1 on a wrong result or
// hang.
//   troupe_churn_soak --minutes 30 [--node-processes 4 --callers 3 --job-items 200 --item-ms 0.2]
#include <dirent.h>
#include <malloc.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "bench_jobs.hpp"
#include "bench_report.hpp"
#include "common/cli.hpp"

/// bench_jobs.hpp's squares with a cost per item (cfg work_ms, a sleep).
struct slow_squares {
  struct producer {
    producer(const troupe::device&, const troupe::config& cfg)
        : work_ms(cfg.get_or("work_ms", 0.0)) {}
    std::int64_t work(std::int64_t x) {
      example::simulate_work(work_ms);
      return x * x;
    }
    double work_ms;
  };
  using consumer = squares::consumer;
};
TROUPE_REGISTER_JOB(slow_squares);

namespace {

using bench::clock_type;
using bench::seconds_since;

/// A node process on a fixed port: started, killed, stopped and started again there.
struct node_process {
  std::string self, address, log;
  pid_t pid = -1;

  void start() {
    std::vector<std::string> args{self, "--serve", address, "--devices", "cpu"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::remove(log.c_str());
    std::fflush(nullptr);  // the child must not write the parent's buffered output again
    pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlives the soak
      auto* out = std::freopen(log.c_str(), "w", stdout);
      auto* err = std::freopen("/dev/null", "w", stderr);
      if (out == nullptr || err == nullptr) _exit(126);
      execv(self.c_str(), argv.data());
      _exit(127);
    }
    for (int i = 0; i < 200; ++i) {  // until it serves (10 s)
      std::ifstream in(log);
      std::string line;
      if (std::getline(in, line) && line.rfind("serving on", 0) == 0) return;
      std::this_thread::sleep_for(std::chrono::milliseconds{50});
    }
    throw std::runtime_error("node " + address + " did not start");
  }
  void signal(int sig) const { ::kill(pid, sig); }
  void reap() {
    waitpid(pid, nullptr, 0);
    pid = -1;
  }
};

/// The default first port of the nodes: below the kernel's ephemeral range (a port in it may be
/// held for a while by an outgoing connection, and a node restarted on it fails to listen), or
/// 47100 where the range cannot be read.
int default_first_port() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0;
  if (in >> low && low > 2000) return low - 1000;
  return 47100;
}

std::size_t count_dir(const char* path) {
  std::size_t n = 0;
  if (DIR* d = opendir(path)) {
    while (auto* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  return n;
}

long rss_kb() {
  std::ifstream in("/proc/self/statm");
  long pages = 0, resident = 0;
  in >> pages >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "troupe_churn_soak: jobs streaming through a live cluster whose nodes are killed, "
      "drained, removed and re-added, and frozen, for a while"};
  example::flags f;
  example::add_flags(app, f);
  double minutes = 1, report_s = 30, hang_s = 60, work_ms = 0.2;
  std::size_t nodes = 4, callers = 3, items = 200;
  int first_port = default_first_port(), only = -1;
  app.add_option("--minutes", minutes);
  app.add_option("--node-processes", nodes, "node processes")->check(CLI::Range(2, 64));
  app.add_option("--callers", callers);
  app.add_option("--job-items", items, "items per job");
  app.add_option("--item-ms", work_ms, "work per item (a sleep)");
  app.add_option("--report-s", report_s);
  app.add_option("--hang-s", hang_s, "a job longer than this is a hang");
  app.add_option("--first-port", first_port,
                 "nodes listen on this port and the next ones (default: 1,000 below the kernel's "
                 "ephemeral ports)");
  app.add_option("--only", only,
                 "one kind of change only (0 kill+restart, 1 drain+restart, 2 remove+add, 3 "
                 "freeze): which one the resources follow")
      ->check(CLI::Range(-1, 3));
  CLI11_PARSE(app, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;  // --serve: a node

  std::string dir = "/tmp/troupe-soak-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  std::vector<node_process> ps(nodes);
  std::vector<std::string> addresses;
  for (std::size_t i = 0; i < nodes; ++i) {
    ps[i].self = argv[0];
    ps[i].address = "127.0.0.1:" + std::to_string(first_port + static_cast<int>(i));
    ps[i].log = dir + "/node" + std::to_string(i);
    ps[i].start();
    addresses.push_back(ps[i].address);
  }
  std::atomic<std::uint64_t> changes{0}, ok{0}, wrong{0}, failed{0}, hangs{0};
  troupe::cluster_options o;
  o.connect_timeout = std::chrono::seconds{2};
  auto t_start = clock_type::now();
  o.on_change = [&, t_start](const troupe::membership_event& e) {
    changes += 1;
    if (f.verbose)
      std::fprintf(stderr, "%8.3f %s %s #%llu\n", seconds_since(t_start), e.node.c_str(),
                   troupe::to_string(e.what), static_cast<unsigned long long>(e.incarnation));
  };
  auto cluster = troupe::cluster::connect(addresses, {}, o);
  troupe::config cfg;
  cfg.set("work_ms", work_ms);
  troupe::unordered_runner<slow_squares> runner{cluster, cfg};

  std::atomic<bool> stop{false};
  std::mutex mtx;
  double longest_job = 0, longest_call = 0;
  std::string last_failure;                           // of a membership action
  std::vector<std::string> job_failures;              // the first few
  std::vector<std::atomic<double>> started(callers);  // seconds since the soak began, or -1
  auto t0 = clock_type::now();
  std::vector<std::thread> threads;
  for (std::size_t c = 0; c < callers; ++c) {
    started[c] = -1;
    threads.emplace_back([&, c] {
      std::mt19937_64 rng{c + 1};
      while (!stop) {
        std::vector<std::int64_t> xs(items);
        std::int64_t expected = 0;
        for (auto& x : xs) {
          x = static_cast<std::int64_t>(rng() % 100000);
          expected += x * x;
        }
        auto t = clock_type::now();
        started[c] = seconds_since(t0);
        try {
          auto got = runner.run(xs);
          (got == expected ? ok : wrong) += 1;
        } catch (const std::exception& e) {
          failed += 1;
          {
            std::lock_guard<std::mutex> g{mtx};
            if (job_failures.size() < 5) job_failures.push_back(e.what());
          }
          std::this_thread::sleep_for(std::chrono::milliseconds{10});
        }
        started[c] = -1;
        std::lock_guard<std::mutex> g{mtx};
        longest_job = std::max(longest_job, seconds_since(t));
      }
    });
  }

  std::mt19937_64 rng{42};
  const char* names[] = {"kill+restart", "drain+restart", "remove+add", "freeze"};
  std::uint64_t actions[4] = {0, 0, 0, 0};
  auto next_report = report_s;
  std::printf("%8s %8s %6s %6s %6s %9s %9s %8s %6s %5s %6s %9s %10s\n", "elapsed", "jobs", "wrong",
              "failed", "hangs", "longest", "call", "changes", "slots", "thr", "fds", "rss_kB",
              "heap_kB");
  while (seconds_since(t0) < minutes * 60) {
    std::this_thread::sleep_for(std::chrono::milliseconds{1000 + rng() % 1000});
    auto i = static_cast<std::size_t>(rng() % nodes);
    auto what = only >= 0 ? only : static_cast<int>(rng() % 4);
    auto call = clock_type::now();
    if (f.verbose)
      std::fprintf(stderr, "%8.3f action %s on %s\n", seconds_since(t_start), names[what],
                   ps[i].address.c_str());
    try {
      switch (what) {
        case 0:
          ps[i].signal(SIGKILL);
          ps[i].reap();
          ps[i].start();
          break;
        case 1:
          ps[i].signal(SIGTERM);
          ps[i].reap();
          ps[i].start();
          break;
        case 2:
          cluster.remove(ps[i].address);
          cluster.add(ps[i].address);
          break;
        default:
          ps[i].signal(SIGSTOP);
          std::this_thread::sleep_for(std::chrono::milliseconds{500 + rng() % 2500});
          ps[i].signal(SIGCONT);
          break;
      }
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> g{mtx};
      last_failure = std::string{names[what]} + " " + ps[i].address + ": " + e.what();
    }
    actions[what] += 1;
    if (what == 2) {
      std::lock_guard<std::mutex> g{mtx};
      longest_call = std::max(longest_call, seconds_since(call));
    }
    auto now = seconds_since(t0);
    for (auto& s : started)
      if (double b = s; b >= 0 && now - b > hang_s) {
        hangs += 1;
        s = -1;  // counted once
      }
    if (now >= next_report) {
      next_report += report_s;
      auto heap = mallinfo2();
      std::lock_guard<std::mutex> g{mtx};
      std::printf(
          "%7.0fs %8llu %6llu %6llu %6llu %8.2fs %8.2fs %8llu %6zu %5zu %6zu %9ld %10zu\n", now,
          static_cast<unsigned long long>(ok.load()), static_cast<unsigned long long>(wrong.load()),
          static_cast<unsigned long long>(failed.load()),
          static_cast<unsigned long long>(hangs.load()), longest_job, longest_call,
          static_cast<unsigned long long>(changes.load()), runner.stats().producers.size(),
          count_dir("/proc/self/task"), count_dir("/proc/self/fd"), rss_kb(), heap.uordblks / 1024);
      std::fflush(stdout);
    }
  }
  stop = true;
  if (hangs > 0) {  // a caller may never come back: report and leave without joining it
    std::printf("jobs %llu, wrong %llu, hangs %llu\n", static_cast<unsigned long long>(ok.load()),
                static_cast<unsigned long long>(wrong.load()),
                static_cast<unsigned long long>(hangs.load()));
    for (auto& p : ps) p.signal(SIGKILL);
    std::fflush(stdout);
    std::_Exit(1);
  }
  for (auto& t : threads) t.join();
  std::printf(
      "actions: %llu kill+restart, %llu drain+restart, %llu remove+add, %llu freeze\n",
      static_cast<unsigned long long>(actions[0]), static_cast<unsigned long long>(actions[1]),
      static_cast<unsigned long long>(actions[2]), static_cast<unsigned long long>(actions[3]));
  std::printf(
      "jobs %llu, wrong %llu, failed %llu, hangs %llu%s%s\n",
      static_cast<unsigned long long>(ok.load()), static_cast<unsigned long long>(wrong.load()),
      static_cast<unsigned long long>(failed.load()), static_cast<unsigned long long>(hangs.load()),
      last_failure.empty() ? "" : "; last membership call that threw: ", last_failure.c_str());
  for (auto& e : job_failures) std::printf("a job failed: %s\n", e.c_str());
  for (auto& p : ps) {
    p.signal(SIGKILL);
    p.reap();
  }
  std::filesystem::remove_all(dir);
  return wrong == 0 && hangs == 0 ? 0 : 1;
}
