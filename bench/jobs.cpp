// Many jobs on one runner: the latency of a 1-item urgent job submitted while a 2M-item job
// runs (100 submissions), and how two jobs with weights 3 and 1 share the producers.
// Items take ~1.5 us of CPU each (a calibrated arithmetic loop), 2 CPU producers.
// Usage: troupe_jobs_bench [--items N] [--urgent N] [--item-us U]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <thread>
#include <troupe/troupe.hpp>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;
volatile std::uint64_t loop_iterations = 1000;

std::uint64_t spin(std::uint64_t x) {
  for (std::uint64_t i = 0, n = loop_iterations; i < n; ++i) x = x * 6364136223846793005ULL + 1;
  return x;
}

struct cpu_items {
  struct producer {
    std::uint64_t work(std::uint64_t x) { return spin(x); }
  };
  struct consumer {
    void work(std::uint64_t y) { sum ^= y; }
    std::uint64_t end() { return sum; }
    std::uint64_t sum = 0;
  };
};

double calibrate(double item_us) {
  loop_iterations = 100000;
  auto t0 = clock_type::now();
  volatile auto sink = spin(1);
  (void)sink;
  auto ns = std::chrono::duration<double, std::nano>(clock_type::now() - t0).count() / 100000;
  loop_iterations = static_cast<std::uint64_t>(item_us * 1000 / ns);
  return ns;
}

auto counting(std::int64_t n) {
  return troupe::generate([i = std::int64_t{0}, n]() mutable -> std::optional<std::uint64_t> {
    if (n >= 0 && i >= n) return std::nullopt;
    return static_cast<std::uint64_t>(i++);
  });
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe: many jobs on one runner"};
  std::int64_t items = 2'000'000;
  int urgent = 100;
  double item_us = 1.5;
  app.add_option("--items", items, "items of the big job");
  app.add_option("--urgent", urgent, "1-item urgent jobs submitted while it runs");
  app.add_option("--item-us", item_us, "CPU time per item, microseconds");
  CLI11_PARSE(app, argc, argv);
  calibrate(item_us);
  troupe::options opts;
  troupe::unordered_runner<cpu_items> runner{2, {}, opts};
  auto chunk_ms = std::chrono::duration<double, std::milli>(opts.target_chunk_time).count();

  // 1. urgent 1-item jobs while a big job runs
  auto big = runner.submit(counting(items));
  while (big.progress().done == 0 && !big.wait_for(std::chrono::milliseconds{1})) {
  }
  std::vector<double> latency_ms;
  for (int k = 0; k < urgent && !big.done(); ++k) {
    auto t0 = clock_type::now();
    runner.run(std::vector<std::uint64_t>{static_cast<std::uint64_t>(k)});
    latency_ms.push_back(std::chrono::duration<double, std::milli>(clock_type::now() - t0).count());
    std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
  auto big_done_at_end = big.progress().done;
  bool big_finished_first = big.done();
  big.get();
  std::cout << "urgent 1-item jobs while a " << items << "-item job runs (2 producers, items of "
            << item_us << " us, chunks of ~" << chunk_ms << " ms):\n";
  if (latency_ms.empty()) {
    std::cout << "  the big job ended before any urgent job: use more --items\n";
  } else {
    std::cout << "  " << latency_ms.size() << " submissions: p50 " << percentile(latency_ms, 0.5)
              << " ms, p90 " << percentile(latency_ms, 0.9) << " ms, p99 "
              << percentile(latency_ms, 0.99) << " ms, max "
              << *std::max_element(latency_ms.begin(), latency_ms.end())
              << " ms = " << percentile(latency_ms, 0.5) / chunk_ms << " / "
              << *std::max_element(latency_ms.begin(), latency_ms.end()) / chunk_ms
              << " chunk times (p50 / max)\n"
              << "  the big job had delivered " << big_done_at_end << " of " << items
              << " items by the last one" << (big_finished_first ? " (and had ended)" : "") << "\n";
  }

  // 2. weights 3 and 1, both endless, for about a second
  troupe::job_options heavy, light;
  heavy.weight = 3;
  light.weight = 1;
  auto a = runner.submit(counting(-1), heavy);
  auto b = runner.submit(counting(-1), light);
  std::this_thread::sleep_for(std::chrono::milliseconds{300});  // both running
  auto a0 = a.progress().done, b0 = b.progress().done;
  std::this_thread::sleep_for(std::chrono::milliseconds{1000});
  auto a1 = a.progress().done, b1 = b.progress().done;
  a.cancel();
  b.cancel();
  auto da = static_cast<double>(a1 - a0), db = static_cast<double>(b1 - b0);
  std::cout << "two endless jobs, weights 3 and 1, over ~1 s: " << da << " and " << db
            << " items = " << (db > 0 ? da / db : 0) << " : 1\n";
}
