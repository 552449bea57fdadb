// The scheduler's own cost as the pool grows (docs/api.md, "Simulated clusters"): simulated
// nodes of 8 CPU producers each (1, 10, 100 and 1,000 nodes: 8 to 8,000 producers), items of
// 2 ms of virtual time (a new job's chunks start at one item: about one decision per item),
// `--per-producer` items per producer, a tenth of the nodes killed at their 3rd chunk (their
// items go to the others, exactly once) and, from 10 nodes on, a tenth of them joining while
// the job runs (runner::add_devices after submit(): they take work in it). The simulation runs
// on this thread: its CPU time per item is the scheduler's cost per decision plus the
// simulation's own bookkeeping; the time spent in the scheduler actor alone
// (simulation::scheduler_time(), steady clock around each of its runs) is printed too. The
// result is checked.
// --join-storm N: a job on one node instead, and N - 1 nodes joining it at once (one
// add_devices() of (N - 1) x 8 producers while it runs): the CPU of that call, and the items
// the joined producers took.
// --members N: a live cluster's membership bookkeeping (what the watcher does with answers)
// for N members: their joins, then probe rounds (every member answers, then the tick).
// Usage: troupe_sim_scale_bench [--min-nodes 1] [--max-nodes 1000] [--per-producer 20]
// [--join-storm 1000]
//        [--members 1000]
#include <time.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <string>
#include <troupe/internal/membership.hpp>
#include <troupe/simulation.hpp>
#include <utility>
#include <vector>

#include "bench_jobs.hpp"

namespace {

double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

/// Items 0..n-1, and the sum of their squares (the job's exact result).
std::pair<std::vector<std::int64_t>, std::int64_t> numbers(std::int64_t n) {
  std::vector<std::int64_t> xs(static_cast<std::size_t>(n));
  std::iota(xs.begin(), xs.end(), 0);
  std::int64_t expected = 0;
  for (auto x : xs) expected += x * x;
  return {std::move(xs), expected};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"the scheduler's cost per decision from 8 to 8,000 simulated producers"};
  std::size_t min_nodes = 1, max_nodes = 1000, per_producer = 20;
  app.add_option("--min-nodes", min_nodes, "smallest number of simulated nodes (1, 10, 100, ...)");
  app.add_option("--max-nodes", max_nodes, "largest number of simulated nodes");
  app.add_option("--per-producer", per_producer, "items per producer");
  std::size_t storm = 0;
  app.add_option("--join-storm", storm, "nodes in all, all but one joining a running job at once");
  std::size_t members = 0;
  app.add_option("--members", members, "membership bookkeeping of this many members");
  CLI11_PARSE(app, argc, argv);
  if (members > 0) {
    troupe::detail::membership m{std::chrono::milliseconds{1500}};
    std::vector<std::string> names;
    std::vector<std::vector<troupe::device>> devices;
    for (std::size_t i = 0; i < members; ++i) {
      names.push_back("10.0." + std::to_string(i / 250) + "." + std::to_string(i % 250) + ":4242");
      devices.push_back({troupe::device{names.back() + "/cpu:0"}});
    }
    auto t = std::chrono::steady_clock::now();
    auto c0 = cpu_seconds();
    for (std::size_t i = 0; i < members; ++i) m.answered(names[i], i + 1, devices[i], t, true);
    auto joins = cpu_seconds() - c0;
    constexpr int rounds = 20;
    c0 = cpu_seconds();
    for (int k = 0; k < rounds; ++k) {
      t += std::chrono::milliseconds{200};
      auto probed = m.watched();  // the watcher's list for the round
      if (probed.size() != members) return 1;
      for (std::size_t i = 0; i < members; ++i) m.answered(names[i], i + 1, devices[i], t, false);
      (void)m.tick(t);
    }
    auto probes = (cpu_seconds() - c0) / rounds;
    std::cout << members << " members: " << std::fixed << std::setprecision(1)
              << joins / static_cast<double>(members) * 1e6 << " us of CPU per join ("
              << std::setprecision(3) << joins << " s for all), " << std::setprecision(2)
              << probes * 1e3 << " ms per probe round (every member's answer and the tick), "
              << m.members().size() << " members up" << std::endl;
    return m.members().size() == members ? 0 : 1;
  }
  if (storm > 1) {
    troupe::testing::simulation sim{7};
    sim.nodes({"n0:1"}, troupe::cpus(8));
    sim.cost_per_item(std::chrono::milliseconds{2});
    auto r = sim.unordered_runner<squares>(sim.devices());
    auto items = static_cast<std::int64_t>(8 * storm * per_producer);
    auto [xs, expected] = numbers(items);
    std::vector<std::string> later;
    for (std::size_t i = 1; i < storm; ++i) later.push_back("n" + std::to_string(i) + ":1");
    auto c0 = cpu_seconds();
    auto job = r.submit(xs);
    sim.nodes(later, troupe::cpus(8));
    std::vector<troupe::device> added;
    for (auto& d : sim.devices())
      if (d.node() != "n0:1") added.push_back(d);
    auto a0 = cpu_seconds();
    r.add_devices(added);
    auto add_cpu = cpu_seconds() - a0;
    auto got = job.get();
    auto cpu = cpu_seconds() - c0;
    std::size_t took = 0;
    for (auto& p : r.stats().producers)
      if (p.where.node() != "n0:1" && p.items > 0) ++took;
    std::cout << storm - 1 << " nodes (" << added.size() << " producers) joined a running job at "
              << "once: add_devices " << std::fixed << std::setprecision(3) << add_cpu
              << " s of CPU; " << took << " of them took work; the job (" << items << " items) "
              << std::setprecision(2) << cpu << " s of CPU in all, " << std::setprecision(1)
              << cpu / static_cast<double>(items) * 1e6 << " us per item"
              << (got == expected ? ", exact" : ", WRONG RESULT") << std::endl;
    return got == expected ? 0 : 1;
  }
  // One job on n simulated nodes (seed: the simulation's): its CPU, and what the joined took.
  struct outcome {
    double cpu = 0, sched = 0;  ///< the whole simulation's CPU; the schedulers' own time
    std::uint64_t by_joined = 0, chunks = 0, runs = 0;
    bool exact = false;
  };
  // From 10 nodes on, a tenth of them killed and a tenth joining.
  auto tenth = [](std::size_t n) -> std::size_t { return n >= 10 ? n / 10 : 0; };
  auto one = [&](std::size_t n, std::uint64_t seed) {
    troupe::testing::simulation sim{seed};
    auto name = [](std::size_t i) { return "n" + std::to_string(i) + ":1"; };
    auto joining = tenth(n);
    std::vector<std::string> names, later;
    for (std::size_t i = 0; i < n - joining; ++i) names.push_back(name(i));
    for (std::size_t i = n - joining; i < n; ++i) later.push_back(name(i));
    sim.nodes(names, troupe::cpus(8));
    sim.cost_per_item(std::chrono::milliseconds{2});
    auto killed = tenth(n);
    for (std::size_t i = 0; i < killed; ++i) sim.at_chunk(3).kill(names[i]);
    auto r = sim.unordered_runner<squares>(sim.devices());
    auto items = static_cast<std::int64_t>(8 * n * per_producer);
    auto [xs, expected] = numbers(items);
    auto c0 = cpu_seconds();
    auto s0 = sim.scheduler_time();
    auto job = r.submit(xs);
    if (!later.empty()) {  // they join the running job
      sim.nodes(later, troupe::cpus(8));
      std::vector<troupe::device> added;
      for (auto& d : sim.devices())
        if (std::find(later.begin(), later.end(), d.node()) != later.end()) added.push_back(d);
      r.add_devices(added);
    }
    auto got = job.get();
    outcome o;
    o.cpu = cpu_seconds() - c0;
    auto s1 = sim.scheduler_time();
    o.sched = std::chrono::duration<double>(s1.time - s0.time).count();
    o.runs = s1.activations - s0.activations;
    o.exact = got == expected;
    for (auto& p : r.stats().producers) {
      o.chunks += p.chunks;
      if (std::find(later.begin(), later.end(), p.where.node()) != later.end())
        o.by_joined += p.items;
    }
    return o;
  };
  // One job first, untimed: the first job of a process pays its page faults and first-use
  // costs (up to 1.6x the steady figure at 8 producers), which would flatter the large pools.
  (void)one(min_nodes, 1);
  for (std::size_t n = min_nodes; n <= max_nodes; n *= 10) {
    // Small pools run their job again (other seeds) until 1,000 nodes' worth: a job of 160
    // items is over in a millisecond of CPU, too short to time alone.
    auto reps = std::max<std::size_t>(1, 1000 / n / 10);
    outcome sum;
    sum.exact = true;
    for (std::size_t k = 0; k < reps; ++k) {
      auto o = one(n, 7 + k);
      sum.cpu += o.cpu;
      sum.sched += o.sched;
      sum.runs += o.runs;
      sum.by_joined += o.by_joined;
      sum.chunks += o.chunks;
      sum.exact = sum.exact && o.exact;
    }
    auto items = 8 * n * per_producer;
    auto killed = tenth(n);
    auto joining = tenth(n);
    std::cout << std::setw(5) << n << " nodes, " << std::setw(5) << 8 * n << " producers, " << items
              << " items, " << killed << " nodes killed, " << joining << " joined ("
              << sum.by_joined / reps << " items there), " << reps << " run(s): " << std::fixed
              << std::setprecision(3) << sum.cpu / static_cast<double>(reps) << " s of CPU each, "
              << std::setprecision(1) << sum.cpu / static_cast<double>(items * reps) * 1e6
              << " us per item, " << sum.cpu / static_cast<double>(sum.chunks) * 1e6
              << " us per chunk ("
              << static_cast<double>(items * reps) / static_cast<double>(sum.chunks)
              << " items each); the scheduler itself " << std::setprecision(2)
              << sum.sched / static_cast<double>(sum.chunks) * 1e6 << " us per chunk ("
              << sum.sched / static_cast<double>(sum.runs) * 1e6 << " us per activation, "
              << std::setprecision(1)
              << static_cast<double>(sum.runs) / static_cast<double>(sum.chunks) << " per chunk)"
              << (sum.exact ? ", exact" : ", WRONG RESULT") << std::endl;
    if (!sum.exact) return 1;
    if (joining > 0 && sum.by_joined == 0) {
      std::cerr << "the nodes that joined took no work" << std::endl;
      return 1;
    }
  }
}
