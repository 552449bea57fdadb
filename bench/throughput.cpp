// Benchmarks of troupe against a hand-written std::thread pipeline, side by side in one run.
//   trivial: x*x summed over N items on 2 producers (per-item overhead)
//   latency: 8 producers, 2 ms of simulated device time per item, 800 items (vs the ideal)
// Usage: troupe_bench [--items N] [--repeat R]
#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <iostream>
#include <mutex>
#include <thread>
#include <troupe/troupe.hpp>
#include <vector>

#include "bench_jobs.hpp"
#include "bench_report.hpp"

namespace {

using bench::clock_type;
using bench::seconds_since;

struct sleeper {
  struct producer {
    int work(int x) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      return x;
    }
  };
  struct consumer {
    void work(int) { ++n; }
    int end() { return n; }
    int n = 0;
  };
};

/// The baseline: 2 worker threads pull 4096-item chunks from a shared counter, push each value
/// into a mutex-guarded deque; the calling thread pops and sums.
std::int64_t thread_pipeline(std::int64_t n, int workers) {
  std::atomic<std::int64_t> next{0};
  std::mutex mtx;
  std::condition_variable cv;
  std::deque<std::int64_t> queue;
  int running = workers;
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w)
    threads.emplace_back([&] {
      std::vector<std::int64_t> out;
      for (;;) {
        auto first = next.fetch_add(4096);
        if (first >= n) break;
        auto last = std::min(first + 4096, n);
        out.clear();
        for (auto x = first; x < last; ++x) out.push_back(x * x);
        std::lock_guard<std::mutex> guard{mtx};
        for (auto y : out) queue.push_back(y);
        cv.notify_one();
      }
      std::lock_guard<std::mutex> guard{mtx};
      --running;
      cv.notify_one();
    });
  std::int64_t sum = 0;
  std::unique_lock<std::mutex> lock{mtx};
  for (;;) {
    cv.wait(lock, [&] { return !queue.empty() || running == 0; });
    while (!queue.empty()) {
      sum += queue.front();
      queue.pop_front();
    }
    if (running == 0) break;
  }
  lock.unlock();
  for (auto& t : threads) t.join();
  return sum;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe benchmarks"};
  std::int64_t items = 2'000'000;
  int repeat = 3;
  app.add_option("--items", items, "trivial items");
  app.add_option("--repeat", repeat, "repetitions (the best is reported)");
  CLI11_PARSE(app, argc, argv);

  double best_troupe = 1e9, best_threads = 1e9;
  std::int64_t expect = thread_pipeline(items, 2);
  troupe::unordered_runner<squares> runner{2};
  for (int r = 0; r < repeat; ++r) {
    auto t0 = clock_type::now();
    std::int64_t i = 0;
    auto got = runner.run(troupe::generate([&]() -> std::optional<std::int64_t> {
      if (i == items) return std::nullopt;
      return i++;
    }));
    best_troupe = std::min(best_troupe, seconds_since(t0));
    if (got != expect) {
      std::cerr << "troupe result differs: " << got << " vs " << expect << "\n";
      return 1;
    }
    t0 = clock_type::now();
    if (thread_pipeline(items, 2) != expect) return 1;
    best_threads = std::min(best_threads, seconds_since(t0));
  }
  std::cout << "trivial items (" << items << " x*x, 2 producers):\n"
            << "  troupe unordered_runner : " << items / best_troupe / 1e6 << " M items/s\n"
            << "  std::thread pipeline    : " << items / best_threads / 1e6 << " M items/s\n"
            << "  troupe / threads        : " << 100 * best_threads / best_troupe << " %\n";

  troupe::unordered_runner<sleeper> slow{8};
  std::vector<int> in(800);
  double best_slow = 1e9;
  for (int r = 0; r < repeat; ++r) {
    auto t0 = clock_type::now();
    if (slow.run(in) != 800) return 1;
    best_slow = std::min(best_slow, seconds_since(t0));
  }
  double ideal = 800 * 0.002 / 8;
  std::cout << "simulated latency (800 items x 2 ms, 8 producers):\n"
            << "  troupe  : " << best_slow * 1e3 << " ms (ideal " << ideal * 1e3 << " ms)\n"
            << "  of ideal: " << 100 * ideal / best_slow << " %\n";
}
