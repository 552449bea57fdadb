// x*x summed over an in-memory vector of --items int64 (default 2M), troupe against oneTBB
// written the way a TBB user writes it for data already in memory: tbb::parallel_pipeline with
// a serial input filter that hands out index ranges of the vector (--grain items each, default
// 65536, the chunk troupe settles on for x*x), a parallel filter that computes over its range
// (the squares summed there, no copy of any item), and a serial final filter that adds the
// partial sums (serial_in_order for the ordered line, serial_out_of_order for the other).
// 2 TBB threads in all (global_control + task_arena) against 2 troupe producers;
// troupe's side is run with runner.run(xs) on the same vector (a contiguous range of numbers
// the caller keeps alive), twice: the job of bench_jobs.hpp (producer: x*x; consumer: sum),
// and the same job with consumer::merge (folded_squares: each producer sums its chunks, the
// consumer adds the partial sums, as TBB's filters do).
// The sides take turns, one untimed warm-up run each, then --repeat rounds; best run reported.
// --pause-ms (default 20) sleeps after every run; 0 runs back to back (no thread goes idle).
// Usage: troupe_ranges_bench [--items N] [--grain N] [--repeat R] [--pause-ms P]
//                            [--only troupe|fold|tbb]
#include <tbb/global_control.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <numeric>
#include <string>
#include <thread>
#include <troupe/troupe.hpp>
#include <utility>
#include <vector>

#include "bench_jobs.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
using range = std::pair<std::size_t, std::size_t>;  ///< [first, last) of the vector

std::int64_t tbb_ranges(tbb::task_arena& arena, const std::vector<std::int64_t>& xs,
                        std::size_t grain, bool ordered) {
  std::int64_t sum = 0;
  arena.execute([&] {
    std::size_t next = 0;
    auto input = tbb::make_filter<void, range>(tbb::filter_mode::serial_in_order,
                                               [&](tbb::flow_control& fc) {
                                                 if (next >= xs.size()) {
                                                   fc.stop();
                                                   return range{};
                                                 }
                                                 auto end = std::min(xs.size(), next + grain);
                                                 range r{next, end};
                                                 next = end;
                                                 return r;
                                               });
    auto work =
        tbb::make_filter<range, std::int64_t>(tbb::filter_mode::parallel, [&](const range& r) {
          std::int64_t s = 0;
          for (auto i = r.first; i != r.second; ++i) s += xs[i] * xs[i];
          return s;
        });
    auto total = tbb::make_filter<std::int64_t, void>(
        ordered ? tbb::filter_mode::serial_in_order : tbb::filter_mode::serial_out_of_order,
        [&](std::int64_t s) { sum += s; });
    tbb::parallel_pipeline(4, input & work & total);
  });
  return sum;
}

/// Per-item CPU cost on the calling thread alone, no threads or messages (best of 20 passes over
/// the vector, in ns per item): TBB's range filter (x*x summed over each range); the path an item
/// takes through troupe's job (its producer copies the lent range 16 KiB at a time, stores x*x
/// into the chunk's output buffer; the consumer sums the outputs); and the folded path (the block
/// copy, the next block prefetched, x*x summed straight away). Their ratios are about the most
/// troupe can reach against TBB on the same cores (all CPU-bound), whatever its scheduling.
struct item_costs {
  double tbb = 0, troupe = 0, folded = 0;
};
item_costs per_item_costs(const std::vector<std::int64_t>& xs, std::size_t grain) {
  auto best_of = [&](auto&& pass) {
    double best = 0;
    for (int r = 0; r < 20; ++r) {
      auto t0 = clock_type::now();
      pass();
      auto t = std::chrono::duration<double>(clock_type::now() - t0).count();
      if (best == 0 || t < best) best = t;
    }
    return best * 1e9 / static_cast<double>(xs.size());
  };
  volatile std::int64_t sink = 0;
  item_costs c;
  c.tbb = best_of([&] {
    std::int64_t total = 0;
    for (std::size_t at = 0; at < xs.size(); at += grain) {
      std::int64_t part = 0;
      for (std::size_t i = at, e = std::min(xs.size(), at + grain); i != e; ++i)
        part += xs[i] * xs[i];
      total += part;
    }
    sink = total;
  });
  constexpr std::size_t block = 16384 / sizeof(std::int64_t);
  std::vector<std::int64_t> copy(block), out(grain);
  c.troupe = best_of([&] {
    std::int64_t total = 0;
    for (std::size_t at = 0; at < xs.size(); at += grain) {
      auto n = std::min(grain, xs.size() - at);
      for (std::size_t b = 0; b < n; b += block) {
        auto m = std::min(block, n - b);
        std::memcpy(copy.data(), xs.data() + at + b, m * sizeof(std::int64_t));
        for (std::size_t j = 0; j < m; ++j) out[b + j] = copy[j] * copy[j];
      }
      asm volatile("" : : "r"(out.data()) : "memory");  // the outputs are read elsewhere
      for (std::size_t j = 0; j < n; ++j) total += out[j];
    }
    sink = total;
  });
  c.folded = best_of([&] {
    std::int64_t total = 0;
    for (std::size_t b = 0; b < xs.size(); b += block) {
      auto m = std::min(block, xs.size() - b);
      std::memcpy(copy.data(), xs.data() + b, m * sizeof(std::int64_t));
      auto* next = reinterpret_cast<const char*>(xs.data() + b + m);
      for (std::size_t o = 0; o < std::min(block, xs.size() - b - m) * 8; o += 64)
        __builtin_prefetch(next + o);
      asm volatile("" : : "r"(copy.data()) : "memory");
      for (std::size_t j = 0; j < m; ++j) total += copy[j] * copy[j];
    }
    sink = total;
  });
  (void)sink;
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe against a range-based oneTBB pipeline"};
  std::size_t items = 2'000'000;
  std::size_t grain = 65536;
  int repeat = 15;
  app.add_option("--items", items, "items in the vector");
  app.add_option("--grain", grain, "TBB: items per range");
  app.add_option("--repeat", repeat, "timed runs per side");
  int pause_ms = 20;
  app.add_option("--pause-ms", pause_ms,
                 "pause after every run (0: back to back, threads never go idle)");
  std::string only;
  app.add_option("--only", only, "run one side alone (troupe, fold or tbb), for profiling")
      ->check(CLI::IsMember({"troupe", "fold", "tbb"}));
  CLI11_PARSE(app, argc, argv);

  std::vector<std::int64_t> xs(items);
  std::iota(xs.begin(), xs.end(), 0);
  tbb::global_control limit{tbb::global_control::max_allowed_parallelism, 2};
  tbb::task_arena arena{2};
  troupe::ordered_runner<squares> ordered{2};
  troupe::unordered_runner<squares> unordered{2};
  troupe::ordered_runner<folded_squares> ordered_fold{2};
  troupe::unordered_runner<folded_squares> unordered_fold{2};
  std::int64_t expect = 0;
  for (auto x : xs) expect += x * x;

  auto timed = [&](double& best, auto&& run) {
    auto t0 = clock_type::now();
    auto got = run();
    auto t = std::chrono::duration<double>(clock_type::now() - t0).count();
    if (got != expect) {
      std::cerr << "wrong sum " << got << "\n";
      std::exit(1);
    }
    if (best == 0 || t < best) best = t;
    std::this_thread::sleep_for(std::chrono::milliseconds{pause_ms});
  };
  for (bool in_order : {false, true}) {
    double tbb_best = 0, troupe_best = 0, fold_best = 0, ignored = 0;
    auto tbb_run = [&] { return tbb_ranges(arena, xs, grain, in_order); };
    auto troupe_run = [&] { return in_order ? ordered.run(xs) : unordered.run(xs); };
    auto fold_run = [&] { return in_order ? ordered_fold.run(xs) : unordered_fold.run(xs); };
    bool tbb_side = only != "troupe" && only != "fold", troupe_side = only != "tbb";
    bool plain_side = troupe_side && only != "fold", fold_side = troupe_side && only != "troupe";
    if (tbb_side) timed(ignored, tbb_run);
    if (plain_side) timed(ignored, troupe_run);
    if (fold_side) timed(ignored, fold_run);
    for (int r = 0; r < repeat; ++r) {
      if (tbb_side) timed(tbb_best, tbb_run);
      if (plain_side) timed(troupe_best, troupe_run);
      if (fold_side) timed(fold_best, fold_run);
    }
    auto rate = [&](double s) { return static_cast<double>(items) / s / 1e6; };
    auto pct = [&](double s) { return tbb_best > 0 && s > 0 ? 100 * tbb_best / s : 0.0; };
    std::cout << (in_order ? "ordered  " : "unordered") << " x*x over " << items
              << " items in memory: TBB ranges " << rate(tbb_best) << " M items/s, troupe "
              << rate(troupe_best) << " M items/s = " << pct(troupe_best)
              << " % of TBB, troupe with consumer::merge (folded on the producers) "
              << rate(fold_best) << " M items/s = " << pct(fold_best) << " % of TBB\n";
  }
  if (only.empty()) {
    auto c = per_item_costs(xs, grain);
    std::cout << "per item on one thread, no threads or messages: TBB's range loop " << c.tbb
              << " ns, troupe's item path (block copy, x*x stored, outputs summed) " << c.troupe
              << " ns, folded (block copy, next block prefetched, x*x summed) " << c.folded
              << " ns: the most troupe can reach on the same cores, whatever the scheduling, is "
                 "about "
              << 100 * c.tbb / c.troupe << " % of TBB, folded " << 100 * c.tbb / c.folded << " %\n";
  }
}
