// troupe against oneTBB's tbb::parallel_pipeline, side by side in one process, same chunking.
//
// Both sides run the same three stages: a serial input filter that pulls items from the same
// generator into chunks (a std::vector per chunk), a parallel filter that does the per-item
// work over a chunk into a fresh output vector, and a serial final filter that sums the outputs
// (serial_in_order for ordered runs, serial_out_of_order for unordered ones). troupe runs them
// as its scheduler (input), producers (work) and consumer (sum) with
// troupe::ordered_runner / troupe::unordered_runner and runner.run(troupe::generate(fn)).
//
// Workloads, each ordered and unordered:
//   trivial : x*x over --items int64 items (default 2M), 2 producers vs TBB on 2 threads
//   cpu     : a deterministic arithmetic loop calibrated at startup to about --cpu-us µs per
//             item (default 1.5), --cpu-items items (default 200k), 2 producers vs 2 threads;
//             the sums must be equal on every side
//   sleep   : 2 ms of simulated device latency per item (sleep_for), --sleep-items items
//             (default 800), 8 producers against the ideal n x 2 ms / 8; TBB on 8 threads as a
//             second anchor
//
// Chunking: --chunk 0 (default) gives every workload the chunk troupe's automatic sizing
// settles on (options::target_chunk_time = 2 ms of producer time per chunk, from 1 up to
// options::max_chunk_items = 65536 items: 65536 for x*x, ~1333 for 1.5 µs items, 1 for 2 ms
// items); --chunk N uses N everywhere. TBB always uses that chunk, with 2 x threads tokens.
// troupe runs twice per line: with options::chunk_size fixed to the same chunk (the fair
// comparison, whose ratio is the headline) and with automatic chunks (its default).
//
// TBB's thread count is set twice: tbb::global_control::max_allowed_parallelism (the whole
// process) and a tbb::task_arena of that concurrency (the calling thread is one of the threads),
// so "2 threads" means two threads in all, as troupe's two producers are two threads (troupe's
// scheduler and consumer are threads of their own besides).
//
// Every side gets one untimed warm-up run per line (threads started, troupe's chunk sizes
// learned); then the sides take turns, one run each per round, --repeat rounds, --pause-ms
// (20) apart; the best run of each side is reported.
//
// Usage: troupe_pipeline_bench [--items N] [--cpu-items N] [--cpu-us U] [--sleep-items N]
//                              [--chunk N] [--repeat R] [--only trivial,cpu,sleep]
//                              [--sides fixed,auto,tbb] [--pause-ms MS]
#include <sys/prctl.h>
#include <tbb/global_control.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>
#include <tbb/version.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <troupe/troupe.hpp>
#include <vector>

#include "bench_jobs.hpp"
#include "bench_report.hpp"

namespace {

using bench::clock_type;
using bench::ms;
using bench::pct;
using bench::rate;
using bench::seconds_since;

// -- the per-item work, shared by both sides -------------------------------------------------

/// A dependent chain of multiply, add, shift, xor: nothing a compiler can fold or vectorize.
/// Not inlined, so that both sides run exactly the same code.
__attribute__((noinline)) std::uint64_t spin(std::uint64_t x, std::uint64_t iters) {
  for (std::uint64_t i = 0; i < iters; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    x ^= x >> 29;
  }
  return x;
}

/// Loop iterations that take about `us` microseconds on this machine (best of several tries).
std::uint64_t calibrate_spin(double us) {
  const std::uint64_t probe = 2'000'000;
  double best = 1e9;
  volatile std::uint64_t sink = 0;
  for (int i = 0; i < 7; ++i) {
    auto t0 = clock_type::now();
    sink = sink + spin(static_cast<std::uint64_t>(i) + 1, probe);
    best = std::min(best, seconds_since(t0));
  }
  double ns_per_iter = best * 1e9 / static_cast<double>(probe);
  return std::max<std::uint64_t>(1, static_cast<std::uint64_t>(us * 1e3 / ns_per_iter));
}

/// Nanoseconds slept by sleep_item() since the last reset, over every thread, and how many
/// sleeps: sleep_for(2 ms) oversleeps (timer slack, wake-up latency, a busy host), so the ideal
/// of a run is computed from the mean length of its sleeps (a mean, not the sum: troupe's
/// speculative copies at the end of a run sleep too).
std::atomic<std::int64_t> slept_ns{0}, sleeps{0};

void sleep_item() {
  auto t0 = clock_type::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  slept_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now() - t0).count();
  sleeps += 1;
}

// -- troupe jobs ---------------------------------------------------------------------------

struct spinner {
  struct producer {
    producer(const troupe::device&, const troupe::config& cfg)
        : iters(cfg.get<std::uint64_t>("iters")) {}
    std::uint64_t work(std::uint64_t x) { return spin(x, iters); }
    std::uint64_t iters;
  };
  struct consumer {
    void work(std::uint64_t y) { sum += y; }
    std::uint64_t end() { return sum; }
    std::uint64_t sum = 0;
  };
};

struct sleeper {
  struct producer {
    std::int64_t work(std::int64_t x) {
      sleep_item();
      return x;
    }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

/// The input both sides pull from: 0, 1, ..., n-1, one call per item.
struct counter {
  std::int64_t n;
  std::int64_t i = 0;
  std::optional<std::int64_t> operator()() {
    if (i == n) return std::nullopt;
    return i++;
  }
};

// -- the oneTBB side -----------------------------------------------------------------------

/// tbb::parallel_pipeline over `n` items from a counter, in chunks of `chunk`: serial input
/// filter (fills a vector), parallel filter (f over the chunk into a fresh vector), serial final
/// filter (sums; in order or out of order). Runs inside `arena`.
template <class In, class Out, class F>
Out run_tbb(tbb::task_arena& arena, std::size_t tokens, std::size_t chunk, bool ordered,
            std::int64_t n, F f) {
  Out sum = 0;
  arena.execute([&] {
    counter next{n};
    auto input = tbb::make_filter<void, std::vector<In>*>(
        tbb::filter_mode::serial_in_order, [&](tbb::flow_control& fc) -> std::vector<In>* {
          auto* items = new std::vector<In>;
          items->reserve(chunk);
          while (items->size() < chunk) {
            auto x = next();
            if (!x) break;
            items->push_back(static_cast<In>(*x));
          }
          if (items->empty()) {
            delete items;
            fc.stop();
            return nullptr;
          }
          return items;
        });
    auto work = tbb::make_filter<std::vector<In>*, std::vector<Out>*>(
        tbb::filter_mode::parallel, [&](std::vector<In>* items) {
          auto* out = new std::vector<Out>;
          out->reserve(items->size());
          for (auto x : *items) out->push_back(f(x));
          delete items;
          return out;
        });
    auto total = tbb::make_filter<std::vector<Out>*, void>(
        ordered ? tbb::filter_mode::serial_in_order : tbb::filter_mode::serial_out_of_order,
        [&](std::vector<Out>* out) {
          for (auto y : *out) sum += y;
          delete out;
        });
    tbb::parallel_pipeline(tokens, input & work & total);
  });
  return sum;
}

// -- one line of the report ----------------------------------------------------------------

struct line {
  std::string workload;
  bool ordered = false;
  std::int64_t items = 0;
  std::size_t chunk = 0;
  double troupe_fixed = 0;  ///< best seconds, options::chunk_size = chunk
  double troupe_auto = 0;   ///< best seconds, automatic chunks
  double tbb = 0;           ///< best seconds, tbb::parallel_pipeline
  int tbb_threads = 0;
  std::size_t tbb_tokens = 0;
  double ideal = 0;  ///< the sleep workload: n x 2 ms / producers
  /// The sleep workload: items x the mean length of a sleep in the best run of each side / its
  /// threads (the ideal with the sleeps as long as they really were).
  double slept_fixed = 0, slept_auto = 0, slept_tbb = 0;
};

/// Which sides run (--sides; for profiling one of them alone).
struct side_set {
  bool troupe_fixed = true, troupe_auto = true, tbb = true;
} sides;
/// The pause after every run (--pause-ms).
std::chrono::milliseconds pause_after_run{20};

/// Checks every result against the first one.
template <class Sum>
void check(std::optional<Sum>& expect, Sum got, const char* who) {
  if (!expect) expect = got;
  if (got != *expect) {
    std::cerr << who << ": result " << got << " differs from " << *expect << "\n";
    std::exit(1);
  }
}

/// One workload in one order. The sides take turns: one untimed warm-up run each, then
/// `repeat` rounds of one timed run per side (so that a slow spell of a shared machine hits
/// every side alike), with a pause after every run (--pause-ms, 20 by default: TBB's workers
/// spin a little before they sleep, and nothing of one side may still run during another's
/// timing). Best time per side.
template <class Runner, class In, class Out, class F>
line measure_order(line l, std::size_t producers, int repeat, const troupe::config& cfg, F f,
                   std::optional<Out>& expect) {
  // 'max_allowed_parallelism' caps the whole process; the arena asks for exactly this many
  // threads (the calling thread is one of them), also above the core count (sleep workload).
  tbb::global_control limit{tbb::global_control::max_allowed_parallelism,
                            static_cast<std::size_t>(l.tbb_threads)};
  tbb::task_arena arena{l.tbb_threads};
  troupe::options fixed_opts;
  fixed_opts.chunk_size = l.chunk;
  // Producers started before any timing.
  std::optional<Runner> fixed, automatic;
  if (sides.troupe_fixed) fixed.emplace(producers, cfg, fixed_opts);
  if (sides.troupe_auto) automatic.emplace(producers, cfg, troupe::options{});

  auto pause = [] { std::this_thread::sleep_for(pause_after_run); };
  auto timed = [&](double& best, double& slept, double threads, const char* who, auto&& run) {
    slept_ns = 0;
    sleeps = 0;
    auto t0 = clock_type::now();
    Out got = run();
    double t = seconds_since(t0);
    check<Out>(expect, got, who);
    if (best == 0 || t < best) {
      best = t;
      auto mean =
          sleeps > 0 ? static_cast<double>(slept_ns) * 1e-9 / static_cast<double>(sleeps) : 0.0;
      slept = static_cast<double>(l.items) * mean / threads;
    }
    pause();
  };
  auto tbb_run = [&] {
    return run_tbb<In, Out>(arena, l.tbb_tokens, l.chunk, l.ordered, l.items, f);
  };
  auto troupe_run = [&](Runner& r) {
    return [&r, n = l.items] { return static_cast<Out>(r.run(troupe::generate(counter{n}))); };
  };
  auto p = static_cast<double>(producers), t = static_cast<double>(l.tbb_threads);
  double ignored = 0, ignored_too = 0;
  if (sides.tbb) timed(ignored, ignored_too, t, "tbb", tbb_run);
  if (fixed) timed(ignored, ignored_too, p, "troupe, fixed chunks", troupe_run(*fixed));
  if (automatic) timed(ignored, ignored_too, p, "troupe, automatic chunks", troupe_run(*automatic));
  for (int r = 0; r < repeat; ++r) {
    if (sides.tbb) timed(l.tbb, l.slept_tbb, t, "tbb", tbb_run);
    if (fixed) timed(l.troupe_fixed, l.slept_fixed, p, "troupe, fixed chunks", troupe_run(*fixed));
    if (automatic)
      timed(l.troupe_auto, l.slept_auto, p, "troupe, automatic chunks", troupe_run(*automatic));
  }
  return l;
}

/// Measures one workload, ordered and unordered: troupe with fixed and automatic chunks on
/// `producers` producers, TBB on `tbb_threads` threads with 2 x tbb_threads tokens.
template <class Job, class In, class Out, class F>
std::vector<line> measure(const std::string& name, std::int64_t n, std::size_t chunk,
                          std::size_t producers, int tbb_threads, int repeat,
                          const troupe::config& cfg, F f, std::optional<Out>& expect) {
  line l;
  l.workload = name;
  l.items = n;
  l.chunk = chunk;
  l.tbb_threads = tbb_threads;
  l.tbb_tokens = 2 * static_cast<std::size_t>(tbb_threads);
  std::vector<line> lines;
  l.ordered = true;
  lines.push_back(
      measure_order<troupe::ordered_runner<Job>, In, Out>(l, producers, repeat, cfg, f, expect));
  l.ordered = false;
  lines.push_back(
      measure_order<troupe::unordered_runner<Job>, In, Out>(l, producers, repeat, cfg, f, expect));
  return lines;
}

/// troupe's automatic chunk for items of `ns_per_item`: 2 ms of producer time, 1 to 65536.
std::size_t automatic_chunk(double ns_per_item) {
  troupe::options defaults;
  double target = std::chrono::duration<double, std::nano>(defaults.target_chunk_time).count();
  return std::clamp<std::size_t>(static_cast<std::size_t>(target / std::max(ns_per_item, 1e-3)), 1,
                                 defaults.max_chunk_items);
}

}  // namespace

int main(int argc, char** argv) {
  // Timer slack 1 ns instead of Linux's default 50 us, for this thread and every thread started
  // after it (troupe's and TBB's alike): a simulated 2 ms device wait then lasts about 2 ms on
  // both sides instead of up to 2.1 ms, which would hide what each side adds.
  prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
  CLI::App app{"troupe against oneTBB's parallel_pipeline, same chunking"};
  std::int64_t items = 2'000'000, cpu_items = 200'000, sleep_items = 800;
  double cpu_us = 1.5;
  std::size_t chunk_opt = 0;
  int repeat = 3;
  std::vector<std::string> only{"trivial", "cpu", "sleep"};
  app.add_option("--items", items, "trivial items (x*x)");
  app.add_option("--cpu-items", cpu_items, "CPU-bound items");
  app.add_option("--cpu-us", cpu_us, "microseconds of work per CPU-bound item");
  app.add_option("--sleep-items", sleep_items, "2 ms items");
  app.add_option("--chunk", chunk_opt,
                 "items per chunk on both sides; 0 = what troupe's automatic sizing settles on");
  app.add_option("--repeat", repeat, "timed repetitions (the best is reported)");
  app.add_option("--only", only, "workloads: trivial, cpu, sleep")->delimiter(',');
  std::vector<std::string> side_names{"fixed", "auto", "tbb"};
  app.add_option("--sides", side_names,
                 "what runs: fixed (troupe, chunk_size fixed), auto "
                 "(troupe, automatic chunks), tbb; e.g. for profiling")
      ->delimiter(',');
  int pause_ms = 20;
  app.add_option("--pause-ms", pause_ms, "pause after every timed run, in milliseconds");
  CLI11_PARSE(app, argc, argv);
  pause_after_run = std::chrono::milliseconds{pause_ms};
  auto has = [&](const char* x) {
    return std::find(side_names.begin(), side_names.end(), x) != side_names.end();
  };
  sides = side_set{has("fixed"), has("auto"), has("tbb")};
  auto wanted = [&](const char* w) { return std::find(only.begin(), only.end(), w) != only.end(); };

  std::cout << "oneTBB " << TBB_VERSION_MAJOR << "." << TBB_VERSION_MINOR << ", "
            << std::thread::hardware_concurrency() << " hardware threads, best of " << repeat
            << " rounds (sides interleaved, after 1 warm-up run each)\n"
            << "chunk: " << (chunk_opt ? "fixed by --chunk" : "troupe's automatic target")
            << " on both sides; troupe runs with options::chunk_size = that chunk ('fixed', the "
               "ratio) and with automatic chunks ('auto')\n\n";

  std::vector<line> lines;
  if (wanted("trivial")) {
    // x*x takes well under 1 ns: troupe's automatic chunks grow to max_chunk_items.
    auto chunk = chunk_opt ? chunk_opt : automatic_chunk(0.5);
    std::optional<std::int64_t> expect;
    auto l = measure<squares, std::int64_t, std::int64_t>(
        "trivial x*x", items, chunk, 2, 2, repeat, {}, [](std::int64_t x) { return x * x; },
        expect);
    lines.insert(lines.end(), l.begin(), l.end());
  }
  if (wanted("cpu")) {
    auto iters = calibrate_spin(cpu_us);
    // The time per item as the producers will see it (the calibration measures the loop alone).
    auto t0 = clock_type::now();
    volatile std::uint64_t sink = 0;
    for (int i = 0; i < 2000; ++i) sink = sink + spin(static_cast<std::uint64_t>(i), iters);
    double ns_per_item = seconds_since(t0) * 1e9 / 2000;
    std::cout << "cpu items: " << iters << " loop iterations, " << ns_per_item / 1e3
              << " us each on one thread\n";
    auto chunk = chunk_opt ? chunk_opt : automatic_chunk(ns_per_item);
    troupe::config cfg;
    cfg.set("iters", iters);
    std::optional<std::uint64_t> expect;
    auto l = measure<spinner, std::uint64_t, std::uint64_t>(
        "cpu ~" + std::to_string(cpu_us).substr(0, 4) + " us", cpu_items, chunk, 2, 2, repeat, cfg,
        [iters](std::uint64_t x) { return spin(x, iters); }, expect);
    lines.insert(lines.end(), l.begin(), l.end());
  }
  if (wanted("sleep")) {
    auto chunk = chunk_opt ? chunk_opt : automatic_chunk(2e6);
    std::optional<std::int64_t> expect;
    auto l = measure<sleeper, std::int64_t, std::int64_t>(
        "sleep 2 ms", sleep_items, chunk, 8, 8, repeat, {},
        [](std::int64_t x) {
          sleep_item();
          return x;
        },
        expect);
    for (auto& x : l) x.ideal = static_cast<double>(sleep_items) * 0.002 / 8;
    lines.insert(lines.end(), l.begin(), l.end());
  }
  std::cout << "\n";

  std::printf("%-16s %-9s %9s %6s %13s %13s %24s %14s %14s\n", "workload", "order", "items",
              "chunk", "troupe fixed", "troupe auto", "anchor", "fixed/anchor", "auto/anchor");
  for (auto& l : lines) {
    auto n = static_cast<double>(l.items);
    const char* order = l.ordered ? "ordered" : "unordered";
    if (l.ideal > 0) {
      std::printf("%-16s %-9s %9lld %6zu %13s %13s %24s %14s %14s\n", l.workload.c_str(), order,
                  static_cast<long long>(l.items), l.chunk, ms(l.troupe_fixed).c_str(),
                  ms(l.troupe_auto).c_str(), ("ideal " + ms(l.ideal)).c_str(),
                  pct(l.ideal, l.troupe_fixed).c_str(), pct(l.ideal, l.troupe_auto).c_str());
      std::printf("%-16s %-9s %9s %6s %13s %13s %24s %14s %14s\n", "", "", "", "", "", "",
                  ("as slept (TBB " + pct(l.slept_tbb, l.tbb) + ")").c_str(),
                  pct(l.slept_fixed, l.troupe_fixed).c_str(),
                  pct(l.slept_auto, l.troupe_auto).c_str());
      std::printf("%-16s %-9s %9s %6s %13s %13s %24s %14s %14s\n", "", "", "", "", "", "",
                  ("TBB " + std::to_string(l.tbb_threads) + " thr: " + ms(l.tbb)).c_str(),
                  pct(l.tbb, l.troupe_fixed).c_str(), pct(l.tbb, l.troupe_auto).c_str());
    } else {
      std::printf("%-16s %-9s %9lld %6zu %13s %13s %24s %14s %14s\n", l.workload.c_str(), order,
                  static_cast<long long>(l.items), l.chunk, rate(n, l.troupe_fixed).c_str(),
                  rate(n, l.troupe_auto).c_str(),
                  ("TBB " + std::to_string(l.tbb_threads) + " thr: " + rate(n, l.tbb)).c_str(),
                  pct(l.tbb, l.troupe_fixed).c_str(), pct(l.tbb, l.troupe_auto).c_str());
    }
  }
  std::cout
      << "\ntroupe: "
      << "2 CPU producers (8 for sleep); TBB: tbb::parallel_pipeline with "
      << "max_allowed_parallelism = task_arena concurrency = threads, 2 x threads tokens\n"
      << "ratio = troupe's speed / the anchor's: TBB; for sleep the ideal n x 2 ms / 8, "
         "then 'as slept': n x the mean length of the run's sleeps / 8 (TBB's own in brackets), "
         "then TBB on 8 threads\n";
}
