// Uneven work (docs/api.md, "Chunks that follow the work"): what the per-job cost model does
// where items differ in cost, against oneTBB's parallel_for with its auto_partitioner over the
// same items, same run, as many TBB threads as troupe producers. Items are busy-waits of a given
// number of microseconds (work on the CPU, not sleeps).
//   slow-after-fast  5 jobs of 200,000 trivial items, then one job of 3,000 items of 200 us
//   slow-patch       100,000 trivial items with 1,500 items of 400 us in the middle
//   lognormal        20,000 items whose cost is drawn from a lognormal (median 50 us, sigma 1.5),
//                    as plain numbers, with a consumer that merges (lognormal-merge: folded on
//                    the producers) and as items with troupe_cost (lognormal-cost)
//   batch            a batch producer of 2 ms per call + 10 us per item, a plain run() of 5,000
//                    items (--batch-items), against fixed chunk sizes (a sweep)
// For each: the makespan, the ideal (total work / producers, or the longest item when longer),
// and the items computed twice (stats().duplicated_items).
// With --node-processes N, slow-patch and lognormal run on N node processes of one CPU producer
// each (this program started again with --serve), against as many TBB threads; --no-split turns
// options::split_late_chunks off (a node's late chunk is then only copied, as before trims).
// Usage: troupe_uneven_bench [--producers 3] [--only NAME] [--ordered]
//                            [--node-processes N [--no-split]]
#include <sched.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <troupe/troupe.hpp>
#include <vector>

#include "bench_report.hpp"
#include "child_node.hpp"
#include "common/cli.hpp"

namespace {

using bench::clock_type;
using bench::seconds_since;

/// CPU time of the calling thread, or of the whole process.
std::int64_t cpu_ns(clockid_t which) {
  timespec t{};
  clock_gettime(which, &t);
  return static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

/// CPU time spent inside items (spin_us), by every thread: the process's CPU time beyond it is
/// what troupe (or oneTBB) itself cost.
std::atomic<std::int64_t> item_cpu_ns{0};

/// Busy for `us` microseconds (0: nothing).
void spin_us(std::int64_t us) {
  if (us <= 0) return;
  auto c0 = cpu_ns(CLOCK_THREAD_CPUTIME_ID);
  auto until = clock_type::now() + std::chrono::microseconds{us};
  while (clock_type::now() < until) {
  }
  item_cpu_ns.fetch_add(cpu_ns(CLOCK_THREAD_CPUTIME_ID) - c0, std::memory_order_relaxed);
}

/// The process's CPU time outside items while `f` runs, in ms.
template <class F>
double own_cpu_ms(F&& f) {
  auto p0 = cpu_ns(CLOCK_PROCESS_CPUTIME_ID);
  auto i0 = item_cpu_ns.load();
  f();
  return static_cast<double>(cpu_ns(CLOCK_PROCESS_CPUTIME_ID) - p0 - (item_cpu_ns.load() - i0)) *
         1e-6;
}

/// producer::work() calls of the costed jobs in this process (each works one item): with none
/// duplicated, as many as the job's items.
std::atomic<std::uint64_t> work_calls{0};

/// An item: its cost in microseconds.
struct costed {
  struct producer {
    std::int64_t work(std::int64_t us) {
      work_calls.fetch_add(1, std::memory_order_relaxed);
      spin_us(us);
      return us;
    }
  };
  struct consumer {
    void work(std::int64_t us) { total += us; }
    std::int64_t end() { return total; }
    std::int64_t total = 0;
  };
};

template <class Job>
struct job_tag {
  using type = Job;
};

/// The same work, with a consumer that can merge another (docs/api.md, "Folding on the
/// producers"): local producers fold their chunks' outputs, so no chunk's outputs travel to the
/// consumer one by one.
struct costed_merged {
  using producer = costed::producer;
  struct consumer : costed::consumer {
    void merge(consumer&& other) { total += other.total; }
  };
};

/// An item whose cost its user states (docs/api.md, "Item costs: troupe_cost"): microseconds.
struct stated {
  std::int64_t us = 0;
};
double troupe_cost(const stated& x) {
  return static_cast<double>(x.us);
}

/// The same work as `costed`, on items with troupe_cost.
struct costed_stated {
  struct producer {
    std::int64_t work(const stated& x) {
      work_calls.fetch_add(1, std::memory_order_relaxed);
      spin_us(x.us);
      return x.us;
    }
  };
  using consumer = costed::consumer;
};

/// 2 ms per call + 10 us per item (a forward pass on a GPU).
struct batched {
  struct producer {
    std::vector<std::int64_t> work(troupe::span<const std::int64_t> xs) {
      auto t0 = clock_type::now();
      int cpu0 = sched_getcpu();
      spin_us(2000 + 10 * static_cast<std::int64_t>(xs.size()));
      calls += 1;
      if (record) {
        auto t1 = clock_type::now();
        std::lock_guard<std::mutex> guard{mtx};
        sizes.push_back({std::this_thread::get_id(), xs.size(), t0, t1, cpu0, sched_getcpu()});
      }
      return {xs.begin(), xs.end()};
    }
    static inline std::atomic<std::uint64_t> calls{0};
    // --sizes: each call's size and its producer's thread, in order.
    static inline bool record = false;
    static inline std::mutex mtx;
    struct call {
      std::thread::id thread;
      std::size_t items;
      clock_type::time_point began, ended;
      int cpu0, cpu1;
    };
    static inline std::vector<call> sizes;
  };
  struct consumer {
    void work(std::int64_t) { n += 1; }
    std::int64_t end() { return n; }
    std::int64_t n = 0;
  };
};

}  // namespace

TROUPE_REGISTER_JOB(costed);
TROUPE_REGISTER_JOB(costed_merged);

namespace {

double ideal_of(const std::vector<std::int64_t>& us, std::size_t producers) {
  double total = 0;
  std::int64_t longest = 0;
  for (auto x : us) {
    total += static_cast<double>(x);
    longest = std::max(longest, x);
  }
  return std::max(total / static_cast<double>(producers), static_cast<double>(longest)) * 1e-6;
}

/// oneTBB's CPU outside items in its last run (ms).
double tbb_own_ms = 0;

double tbb_makespan(tbb::task_arena& arena, const std::vector<std::int64_t>& us) {
  auto t0 = clock_type::now();
  tbb_own_ms = own_cpu_ms([&] {
    arena.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<std::size_t>(0, us.size()),
          [&](const tbb::blocked_range<std::size_t>& r) {
            for (auto i = r.begin(); i != r.end(); ++i) spin_us(us[i]);
          },
          tbb::auto_partitioner{});
    });
  });
  return seconds_since(t0);
}

/// One case's line; `calls`: its producer::work() calls (-1: not counted, on nodes).
void report(const std::string& name, double secs, double ideal, std::uint64_t duplicated,
            std::size_t items, double tbb, std::int64_t calls) {
  std::cout << std::left << std::setw(18) << name << std::right << std::fixed
            << std::setprecision(3) << " troupe " << secs << " s  ideal " << ideal << " s  ("
            << std::setprecision(2) << secs / ideal << "x)  duplicated " << duplicated << " of "
            << items;
  if (calls >= 0) std::cout << ", work() " << calls;
  if (tbb > 0)
    std::cout << "  | oneTBB auto_partitioner " << std::setprecision(3) << tbb << " s ("
              << std::setprecision(2) << tbb / ideal << "x)";
  std::cout << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe on uneven work, against oneTBB"};
  std::size_t producers = 3, nodes = 0;
  std::string only;
  bool sizes = false, timed = false, no_split = false;
  example::flags f;  // --serve: this program as a node (--node-processes starts it so)
  example::add_flags(app, f);
  app.add_option("--producers", producers, "CPU producers (and TBB threads)");
  app.add_flag("--sizes", sizes, "batch: print the sizes of the adaptive run's calls, by producer");
  app.add_flag("--timed", timed,
               "batch, with --sizes: each call's start and length (ms), and its CPUs");
  app.add_option(
      "--only", only,
      "slow-after-fast, slow-patch, lognormal, lognormal-merge, lognormal-cost or batch");
  app.add_option("--node-processes", nodes, "slow-patch and lognormal on this many node processes");
  app.add_flag("--no-split", no_split, "options::split_late_chunks off");
  long target_us = 0;
  std::string trace;
  app.add_option("--target-chunk-us", target_us, "options::target_chunk_time (default 2,000)");
  std::size_t batch_items = 5'000;
  app.add_option("--batch-items", batch_items, "batch: the run's items (default 5,000)")
      ->check(CLI::Range(std::size_t{1}, std::size_t{10'000'000}));
  std::size_t backlog = 0;
  app.add_option("--consumer-backlog", backlog, "options::consumer_backlog (default 4)");
  app.add_option("--trace-file", trace, "options::trace_file of the measured runners");
  CLI11_PARSE(app, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;  // --serve: a node
  std::vector<std::unique_ptr<child_node>> children;
  std::optional<troupe::cluster> cluster;
  if (nodes > 0) {
    producers = nodes;
    std::vector<std::string> addresses;
    for (std::size_t i = 0; i < nodes; ++i) {
      children.push_back(std::make_unique<child_node>(argv[0], "cpu"));
      addresses.push_back(children.back()->address);
    }
    cluster = troupe::cluster::connect(addresses);
  }
  tbb::global_control threads{tbb::global_control::max_allowed_parallelism, producers};
  tbb::task_arena arena{static_cast<int>(producers)};
  auto want = [&](const char* name) { return only.empty() || only == name; };

  // Times one job of `us` on runner `r` after `before` jobs of trivial items, against TBB over
  // the same items.
  auto measure_on = [&](auto&& r, const char* name, const std::vector<std::int64_t>& us, int before,
                        std::size_t before_items) {
    for (int i = 0; i < before; ++i) r.run(std::vector<std::int64_t>(before_items, 0));
    auto s0 = r.stats();
    auto c0 = work_calls.load();
    auto t0 = clock_type::now();
    auto own = own_cpu_ms([&] { r.run(us); });
    auto secs = seconds_since(t0);
    auto s1 = r.stats();
    auto calls = cluster ? -1 : static_cast<std::int64_t>(work_calls.load() - c0);
    report(name, secs, ideal_of(us, producers), s1.duplicated_items - s0.duplicated_items,
           us.size(), tbb_makespan(arena, us), calls);
    std::uint64_t chunks = 0;
    for (std::size_t p = 0; p < s1.producers.size(); ++p)
      chunks += s1.producers[p].chunks - (p < s0.producers.size() ? s0.producers[p].chunks : 0);
    chunks += s1.split_chunks - s0.split_chunks;
    std::cout << "  CPU outside the items: troupe " << std::setprecision(1) << own << " ms ("
              << chunks << " chunks, " << std::setprecision(1)
              << own * 1e3 / static_cast<double>(std::max<std::uint64_t>(1, chunks))
              << " us per chunk), oneTBB " << tbb_own_ms << " ms\n";
    if (cluster)
      std::cout << "  on " << nodes << " nodes: " << s1.trims_sent - s0.trims_sent
                << " trims sent, " << s1.split_chunks - s0.split_chunks << " chunks split, "
                << s1.moved_items - s0.moved_items << " items moved\n";
  };
  // The same on a runner of this run's options (--ordered: an ordered runner).
  auto measure = [&](const char* name, const std::vector<std::int64_t>& us, int before,
                     std::size_t before_items, auto job) {
    using Job = typename decltype(job)::type;
    troupe::options o;
    o.split_late_chunks = !no_split;
    if (target_us > 0) o.target_chunk_time = std::chrono::microseconds{target_us};
    if (backlog > 0) o.consumer_backlog = backlog;
    o.trace_file = trace;
    auto devices = cluster ? cluster->devices() : troupe::cpus(producers);
    if (f.ordered)  // --ordered (example::add_flags)
      measure_on(troupe::ordered_runner<Job>{devices, {}, o}, name, us, before, before_items);
    else
      measure_on(troupe::unordered_runner<Job>{devices, {}, o}, name, us, before, before_items);
  };
  if (cluster && (only.empty() || (only != "slow-patch" && only != "lognormal"))) {
    std::cerr << "--node-processes: only slow-patch or lognormal (--only)\n";
    return 2;
  }
  if (want("slow-after-fast"))
    measure("slow-after-fast", std::vector<std::int64_t>(3'000, 200), 5, 200'000,
            job_tag<costed>{});
  if (want("slow-patch")) {
    std::vector<std::int64_t> us(100'000, 0);
    for (std::size_t i = 49'250; i < 50'750; ++i) us[i] = 400;
    measure("slow-patch", us, 1, 1'000, job_tag<costed>{});
  }
  if (want("lognormal") || want("lognormal-merge")) {
    std::mt19937_64 rng{7};
    std::lognormal_distribution<double> cost{std::log(50.0), 1.5};
    std::vector<std::int64_t> us(20'000);
    for (auto& x : us) x = static_cast<std::int64_t>(std::min(50'000.0, cost(rng)));
    if (want("lognormal")) measure("lognormal", us, 1, 1'000, job_tag<costed>{});
    if (want("lognormal-merge") && !cluster)
      measure("lognormal-merge", us, 1, 1'000, job_tag<costed_merged>{});
  }
  if (want("lognormal-cost")) {  // the same items, their cost stated (troupe_cost)
    std::mt19937_64 rng{7};
    std::lognormal_distribution<double> cost{std::log(50.0), 1.5};
    std::vector<std::int64_t> us(20'000);
    for (auto& x : us) x = static_cast<std::int64_t>(std::min(50'000.0, cost(rng)));
    std::vector<stated> xs;
    for (auto x : us) xs.push_back(stated{x});
    troupe::unordered_runner<costed_stated> r{troupe::cpus(producers)};
    r.run(std::vector<stated>(1'000));
    auto dup0 = r.stats().duplicated_items;
    auto c0 = work_calls.load();
    auto t0 = clock_type::now();
    r.run(xs);
    auto secs = seconds_since(t0);
    auto calls = static_cast<std::int64_t>(work_calls.load() - c0);
    report("lognormal-cost", secs, ideal_of(us, producers), r.stats().duplicated_items - dup0,
           us.size(), tbb_makespan(arena, us), calls);
  }
  if (want("batch")) {
    std::vector<std::int64_t> xs(batch_items, 1);
    auto run = [&](std::size_t chunk) {
      troupe::options o;
      o.chunk_size = chunk;
      troupe::unordered_runner<batched> r{troupe::cpus(producers), {}, o};
      batched::producer::calls = 0;
      auto t0 = clock_type::now();
      r.run(xs);
      auto secs = seconds_since(t0);
      std::cout << "batch " << (chunk ? "chunk_size " + std::to_string(chunk) : "adaptive     ")
                << std::fixed << std::setprecision(3) << "  " << secs << " s  "
                << std::setprecision(0) << static_cast<double>(xs.size()) / secs
                << " items/s  mean batch " << std::setprecision(1)
                << static_cast<double>(xs.size()) / static_cast<double>(batched::producer::calls)
                << "\n";
    };
    batched::producer::record = sizes;
    run(0);
    batched::producer::record = false;
    if (sizes) {
      std::map<std::thread::id, std::string> by;
      auto& calls = batched::producer::sizes;
      auto base = calls.empty() ? clock_type::time_point{} : calls.front().began;
      auto ms = [&](clock_type::duration d) {
        std::ostringstream text;
        text << std::fixed << std::setprecision(2)
             << std::chrono::duration<double, std::milli>(d).count();
        return text.str();
      };
      // Each call: its items, when it began (ms after the first), how long it ran, and the CPUs
      // it began and ended on (N@START+LENGTH/cpuA>B).
      for (auto& c : calls)
        by[c.thread] += " " + std::to_string(c.items) +
                        (timed ? "@" + ms(c.began - base) + "+" + ms(c.ended - c.began) + "/cpu" +
                                     std::to_string(c.cpu0) + ">" + std::to_string(c.cpu1)
                               : "");
      for (auto& [t, line] : by) std::cout << "  calls:" << line << "\n";
    }
    for (std::size_t c : {16, 64, 256, 512, 1024, 2048}) run(c);
  }
}
