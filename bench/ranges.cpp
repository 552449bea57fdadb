// x*x summed over an in-memory vector of --items int64 (default 2M), troupe against oneTBB
// written the way a TBB user writes it for data already in memory: tbb::parallel_pipeline with
// a serial input filter that hands out index ranges of the vector (--grain items each, default
// 65536, the chunk troupe settles on for x*x), a parallel filter that computes over its range
// (the squares summed there, no copy of any item), and a serial final filter that adds the
// partial sums (serial_in_order for the ordered line, serial_out_of_order for the other).
// 2 TBB threads in all (global_control + task_arena) against 2 troupe producers;
// troupe's side is the job of bench_jobs.hpp (producer: x*x; consumer: sum) run with
// runner.run(xs) on the same vector: a contiguous range of numbers the caller keeps alive.
// The sides take turns, one untimed warm-up run each, then --repeat rounds; best run reported.
// Usage: troupe_ranges_bench [--items N] [--grain N] [--repeat R]
#include <tbb/global_control.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <numeric>
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe against a range-based oneTBB pipeline"};
  std::size_t items = 2'000'000;
  std::size_t grain = 65536;
  int repeat = 15;
  app.add_option("--items", items, "items in the vector");
  app.add_option("--grain", grain, "TBB: items per range");
  app.add_option("--repeat", repeat, "timed runs per side");
  std::string only;
  app.add_option("--only", only, "run one side alone (troupe or tbb), for profiling")
      ->check(CLI::IsMember({"troupe", "tbb"}));
  CLI11_PARSE(app, argc, argv);

  std::vector<std::int64_t> xs(items);
  std::iota(xs.begin(), xs.end(), 0);
  tbb::global_control limit{tbb::global_control::max_allowed_parallelism, 2};
  tbb::task_arena arena{2};
  troupe::ordered_runner<squares> ordered{2};
  troupe::unordered_runner<squares> unordered{2};
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
    std::this_thread::sleep_for(std::chrono::milliseconds{20});
  };
  for (bool in_order : {false, true}) {
    double tbb_best = 0, troupe_best = 0, ignored = 0;
    auto tbb_run = [&] { return tbb_ranges(arena, xs, grain, in_order); };
    auto troupe_run = [&] { return in_order ? ordered.run(xs) : unordered.run(xs); };
    bool tbb_side = only != "troupe", troupe_side = only != "tbb";
    if (tbb_side) timed(ignored, tbb_run);
    if (troupe_side) timed(ignored, troupe_run);
    for (int r = 0; r < repeat; ++r) {
      if (tbb_side) timed(tbb_best, tbb_run);
      if (troupe_side) timed(troupe_best, troupe_run);
    }
    auto rate = [&](double s) { return static_cast<double>(items) / s / 1e6; };
    std::cout << (in_order ? "ordered  " : "unordered") << " x*x over " << items
              << " items in memory: TBB ranges " << rate(tbb_best) << " M items/s, troupe "
              << rate(troupe_best) << " M items/s = " << 100 * tbb_best / troupe_best
              << " % of TBB\n";
  }
}
