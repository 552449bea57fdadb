// The scheduler's own cost as the pool grows (docs/api.md, "Simulated clusters"): simulated
// nodes of 8 CPU producers each (1, 10, 100 and 1,000 nodes: 8 to 8,000 producers), items of
// 2 ms of virtual time (a new job's chunks start at one item: about one decision per item),
// `--per-producer` items per producer, a tenth of the nodes killed at their 3rd chunk (their
// items go to the others, exactly once) and, from 10 nodes on, a tenth of them joining while
// the job runs (runner::add_devices after submit(): they take work in it). The simulation runs
// on this thread: its CPU time per item is the scheduler's cost per decision plus the
// simulation's own bookkeeping. The result is checked.
// Usage: troupe_sim_scale_bench [--max-nodes 1000] [--per-producer 20]
#include <time.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <string>
#include <troupe/simulation.hpp>
#include <vector>

#include "bench_jobs.hpp"

namespace {

double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"the scheduler's cost per decision from 8 to 8,000 simulated producers"};
  std::size_t max_nodes = 1000, per_producer = 20;
  app.add_option("--max-nodes", max_nodes, "largest number of simulated nodes");
  app.add_option("--per-producer", per_producer, "items per producer");
  CLI11_PARSE(app, argc, argv);
  for (std::size_t n = 1; n <= max_nodes; n *= 10) {
    troupe::testing::simulation sim{7};
    auto name = [](std::size_t i) { return "n" + std::to_string(i) + ":1"; };
    auto joining = n >= 10 ? n / 10 : 0;
    std::vector<std::string> names, later;
    for (std::size_t i = 0; i < n - joining; ++i) names.push_back(name(i));
    for (std::size_t i = n - joining; i < n; ++i) later.push_back(name(i));
    sim.nodes(names, troupe::cpus(8));
    sim.cost_per_item(std::chrono::milliseconds{2});
    auto killed = n >= 10 ? n / 10 : 0;
    for (std::size_t i = 0; i < killed; ++i) sim.at_chunk(3).kill(names[i]);
    auto r = sim.unordered_runner<squares>(sim.devices());
    auto items = static_cast<std::int64_t>(8 * n * per_producer);
    std::vector<std::int64_t> xs(static_cast<std::size_t>(items));
    std::iota(xs.begin(), xs.end(), 0);
    std::int64_t expected = 0;
    for (auto x : xs) expected += x * x;
    auto c0 = cpu_seconds();
    auto job = r.submit(xs);
    if (!later.empty()) {  // they join the running job
      sim.nodes(later, troupe::cpus(8));
      std::vector<troupe::device> added;
      for (auto& d : sim.devices())
        if (std::find(later.begin(), later.end(), d.node()) != later.end()) added.push_back(d);
      r.add_devices(added);
    }
    auto got = job.get();
    auto cpu = cpu_seconds() - c0;
    std::uint64_t by_joined = 0;
    for (auto& p : r.stats().producers)
      if (std::find(later.begin(), later.end(), p.where.node()) != later.end())
        by_joined += p.items;
    std::cout << std::setw(5) << n << " nodes, " << std::setw(5) << 8 * n << " producers, " << items
              << " items, " << killed << " nodes killed, " << joining << " joined (" << by_joined
              << " items there): " << std::fixed << std::setprecision(2) << cpu << " s of CPU, "
              << std::setprecision(1) << cpu / static_cast<double>(items) * 1e6 << " us per item"
              << (got == expected ? ", exact" : ", WRONG RESULT") << std::endl;
    if (got != expected) return 1;
    if (joining > 0 && by_joined == 0) {
      std::cerr << "the nodes that joined took no work" << std::endl;
      return 1;
    }
  }
}
