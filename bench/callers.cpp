// Many callers on one runner (docs/api.md, "One pool, many jobs"), each figure from this one
// process:
//  1. round trip of a 1-item run() on an idle local runner (2 CPU producers): p50, p90, p99;
// 1b. dynamic batching: 64 callers of 1-item jobs sharing calls of a 2 ms + 0.1 ms/item batch
//     producer: the mean batch and how long items wait for their call;
//  2. 16,000 live 3-item jobs submitted at once, drained, against the same jobs 64 at a time;
//  3. promptness with a slow consumer (20 us per item): how long after submit() a 100 ms
//     deadline throws, and how long get() takes after cancel();
//  4. speculative copies, default options: 4 producers, 100 jobs of 8 items at once, work()
//     calls per item delivered; one producer 10 times slower than the others, an ordered run,
//     against the ideal time (the items' total time divided by the producers' speed: 3.1).
// Only the public API: the same file builds against earlier revisions for a side-by-side run.
// Usage: troupe_callers_bench [--round-trips N] [--jobs N] [--skip-slow]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <mutex>
#include <numeric>
#include <thread>
#include <troupe/troupe.hpp>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;
using namespace std::chrono_literals;

double ms_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

std::atomic<std::uint64_t> work_calls{0};

struct squares {
  struct producer {
    std::int64_t work(std::int64_t x) {
      work_calls.fetch_add(1, std::memory_order_relaxed);
      return x * x;
    }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

/// A batch model (2 ms a call + 0.1 ms an item, as a GPU forward pass) that records its calls.
struct batch_model {
  struct call {
    clock_type::time_point start, end;
    std::vector<std::int64_t> items;
  };
  static inline std::vector<call> calls;
  static inline std::mutex mtx;
  struct producer {
    std::vector<std::int64_t> work(troupe::span<const std::int64_t> xs) {
      call c;
      c.start = clock_type::now();
      c.items.assign(xs.begin(), xs.end());
      std::this_thread::sleep_for(2000us + 100us * static_cast<int>(xs.size()));
      c.end = clock_type::now();
      std::lock_guard<std::mutex> guard{mtx};
      calls.push_back(std::move(c));
      return {xs.begin(), xs.end()};
    }
  };
};

/// The consumer spends `consumer_us` per item (busy, as real work would).
struct slow_consumer {
  static inline double consumer_us = 20;
  struct producer {
    std::int64_t work(std::int64_t x) { return x; }
  };
  struct consumer {
    void work(std::int64_t y) {
      auto until = clock_type::now() + std::chrono::duration<double, std::micro>(consumer_us);
      while (clock_type::now() < until) {
      }
      sum += y;
    }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

/// Items that wait `item_us` (as for a device); producer 0 is `slowdown` times slower.
struct uneven {
  static inline double item_us = 1000;
  static inline double slowdown = 10;
  struct producer {
    producer(const troupe::device&, const troupe::config&, std::size_t index)
        : factor(index == 0 ? slowdown : 1) {}
    std::int64_t work(std::int64_t x) {
      std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(item_us * factor));
      return x;
    }
    double factor;
  };
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe: many callers on one runner"};
  int round_trips = 3000;
  int jobs = 16000;
  bool skip_slow = false;
  app.add_option("--round-trips", round_trips, "1-item run() calls to time");
  app.add_option("--jobs", jobs, "3-item jobs submitted at once");
  app.add_flag("--skip-slow", skip_slow, "leave out parts 3 and 4");
  CLI11_PARSE(app, argc, argv);

  // 1. 1-item round trips, without and with dynamic batching (max_delay 0: what the batcher
  // adds to a lone request), in turn.
  for (int round = 0; round < 2; ++round)
    for (bool batched : {false, true}) {
      troupe::options o;
      if (batched) o.batching.max_items = 8;  // max_delay 0
      troupe::unordered_runner<squares> runner{2, {}, o};
      for (int i = 0; i < 200; ++i) runner.run({std::int64_t{i}});  // warm up
      std::vector<double> us;
      auto t0 = clock_type::now();
      for (int i = 0; i < round_trips; ++i) {
        auto t = clock_type::now();
        runner.run({std::int64_t{i}});
        us.push_back(ms_since(t) * 1000);
      }
      auto total = ms_since(t0);
      std::cout << "1-item run() on an idle runner (2 CPU producers"
                << (batched ? ", batching max_items 8, max_delay 0" : "") << "), " << round_trips
                << " calls: p50 " << percentile(us, 0.5) << " us, p90 " << percentile(us, 0.9)
                << " us, p99 " << percentile(us, 0.99) << " us; " << round_trips / total * 1000
                << " calls/s\n";
    }

  {  // 1b. dynamic batching: 4, 16 and 64 callers of 1-item jobs, max_items 8, max_delay 2 ms
     // (4 callers never fill a batch: each call waits max_delay for more).
     // "Held": how long a call started after both its producer was free and its oldest item
     // had been submitted (what the batcher adds by waiting for others; at most max_delay).
    for (int callers : {4, 16, 64}) {
      constexpr int each = 40;
      batch_model::calls.clear();
      std::vector<clock_type::time_point> submitted(static_cast<std::size_t>(callers * each));
      troupe::options o;
      o.batching.max_items = 8;
      o.batching.max_delay = 2000us;
      o.speculative = false;
      troupe::unordered_runner<batch_model> runner{1, {}, o};
      std::vector<std::thread> threads;
      for (int c = 0; c < callers; ++c)
        threads.emplace_back([&, c] {
          for (int i = 0; i < each; ++i) {
            std::int64_t x = c * each + i;
            submitted[static_cast<std::size_t>(x)] = clock_type::now();
            runner.run({x});
          }
        });
      for (auto& t : threads) t.join();
      auto calls = batch_model::calls;
      std::sort(calls.begin(), calls.end(), [](auto& a, auto& b) { return a.start < b.start; });
      std::vector<double> held;
      double items = 0;
      for (std::size_t k = 0; k < calls.size(); ++k) {
        auto oldest = clock_type::time_point::max();
        for (auto x : calls[k].items)
          oldest = std::min(oldest, submitted[static_cast<std::size_t>(x)]);
        auto ready = k == 0 ? oldest : std::max(oldest, calls[k - 1].end);
        held.push_back(std::chrono::duration<double, std::milli>(calls[k].start - ready).count());
        items += static_cast<double>(calls[k].items.size());
      }
      std::cout << "batching, " << callers
                << " callers of 1-item jobs, max_items 8, max_delay 2 ms, a 2 ms + 0.1 ms/item "
                   "producer: mean batch "
                << items / static_cast<double>(calls.size()) << "; a call held past its "
                << "producer and oldest item being ready: p50 " << percentile(held, 0.5)
                << " ms, p99 " << percentile(held, 0.99) << " ms, max " << percentile(held, 1.0)
                << " ms (call " << std::max_element(held.begin(), held.end()) - held.begin()
                << " of " << held.size() << ")\n";
      // The same hold as the batcher itself sees it, in the scheduler (its items' arrival, its
      // producer's answer, the call's send): without the threads' wake-ups around it.
      auto st = runner.stats();
      std::cout << "  the batcher's own hold (runner.stats()): longest "
                << std::chrono::duration<double, std::milli>(st.longest_batch_hold).count()
                << " ms over " << st.batched_calls << " calls\n";
    }
  }

  {  // 2. many live jobs
    troupe::unordered_runner<squares> runner{2};
    std::vector<std::int64_t> three{1, 2, 3};
    auto drain = [&](int window) {
      std::vector<troupe::job_handle<std::int64_t>> live;
      live.reserve(static_cast<std::size_t>(jobs));
      auto t0 = clock_type::now();
      std::int64_t sum = 0;
      std::size_t next_get = 0;
      for (int i = 0; i < jobs; ++i) {
        live.push_back(runner.submit(three));
        if (window > 0 && live.size() - next_get >= static_cast<std::size_t>(window))
          sum += live[next_get++].get();
      }
      for (; next_get < live.size(); ++next_get) sum += live[next_get].get();
      auto ms = ms_since(t0);
      if (sum != 14 * static_cast<std::int64_t>(jobs)) std::cout << "  WRONG SUM " << sum << "\n";
      return ms;
    };
    drain(64);  // warm up
    auto at_once = drain(0);
    auto windowed = drain(64);
    std::cout << jobs << " 3-item jobs: all submitted at once, drained in " << at_once << " ms ("
              << jobs / at_once * 1000 << " jobs/s); 64 at a time " << windowed << " ms ("
              << jobs / windowed * 1000 << " jobs/s); ratio " << at_once / windowed << "\n";
  }
  if (skip_slow) return 0;

  {  // 3. promptness with a slow consumer
    troupe::unordered_runner<slow_consumer> runner{2};
    std::vector<std::int64_t> xs(1'000'000, 1);
    std::vector<double> deadline_ms, cancel_ms;
    for (int rep = 0; rep < 10; ++rep) {
      troupe::job_options o;
      o.deadline = 100ms;
      auto t0 = clock_type::now();
      try {
        runner.run(xs, o);
      } catch (const troupe::deadline_exceeded&) {
      }
      deadline_ms.push_back(ms_since(t0));
      auto h = runner.submit(troupe::lend(xs));
      std::this_thread::sleep_for(50ms);
      h.cancel();
      auto t1 = clock_type::now();
      try {
        h.get();
      } catch (const troupe::cancelled&) {
      }
      cancel_ms.push_back(ms_since(t1));
    }
    std::cout << "consumer of 20 us/item: a 100 ms deadline throws after p50 "
              << percentile(deadline_ms, 0.5) << " ms, max "
              << *std::max_element(deadline_ms.begin(), deadline_ms.end())
              << " ms; get() after cancel() returns after p50 " << percentile(cancel_ms, 0.5)
              << " ms, max " << *std::max_element(cancel_ms.begin(), cancel_ms.end())
              << " ms (10 runs each)\n";
  }

  {  // 4. speculation
    troupe::unordered_runner<squares> runner{4};
    std::uint64_t delivered = 0;
    work_calls = 0;
    for (int rep = 0; rep < 5; ++rep) {
      std::vector<troupe::job_handle<std::int64_t>> hs;
      for (int j = 0; j < 100; ++j)
        hs.push_back(runner.submit(std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
      for (auto& h : hs) h.get();
      delivered += 800;
    }
    std::cout << "4 producers, 100 jobs of 8 items at once (x5): " << work_calls
              << " work() calls for " << delivered
              << " items = " << static_cast<double>(work_calls) / delivered << "\n";

    troupe::ordered_runner<uneven> slow{4};
    std::vector<std::int64_t> xs(2000);
    std::iota(xs.begin(), xs.end(), 0);
    slow.run(std::vector<std::int64_t>(100, 0));  // warm up: each producer measured
    auto t0 = clock_type::now();
    auto out = slow.run(xs);
    auto ms = ms_since(t0);
    // Producers 1..3 at full speed and producer 0 at a tenth: 3.1 producers' worth.
    auto ideal = static_cast<double>(xs.size()) * uneven::item_us / 1000 / 3.1;
    std::cout << "ordered, 4 producers of which one 10x slower, 2000 items of 1 ms: " << ms
              << " ms, ideal " << ideal << " ms (" << (ms / ideal - 1) * 100 << " % over)"
              << (out == xs ? "" : " WRONG ORDER") << "\n";
  }
}
