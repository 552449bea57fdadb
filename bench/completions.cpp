// Completions without a blocked thread (docs/api.md, "Embedding in applications"), side by
// side in one process on one runner (2 CPU producers, x*x):
//  1. a 1-item job's round trip, submit() to the caller having its result, seven ways in
//     interleaved rounds: get() on the caller's thread; then(f) (f on troupe's thread, the
//     caller spins on a flag it sets); then(post, f) onto a one-thread io_context; co_await
//     troupe::async_get(h, asio::bind_executor(io, callback)) (then() on an executor, the Asio
//     way); troupe::async_get(h, use_awaitable) in a coroutine on a one-thread io_context (which
//     async_get keeps awake 200 us while the job is pending); the same with that spin off
//     (troupe::set_completion_spin(io, 0us): each completion wakes the thread); the same with
//     the io_context polled in a loop (its thread never sleeps, so it needs no waking);
//  2. N jobs in flight at once (each held until all are submitted), awaited by N coroutines on
//     one io_context thread, against N threads each blocked in get(): wall time from the first
//     submit to the last result, and the process's threads at their peak.
// Usage: troupe_completions_bench [--round-trips N] [--rounds N] [--concurrent N]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <troupe/asio.hpp>
#include <troupe/troupe.hpp>
#include <vector>

#include "common/threads.hpp"

namespace net = boost::asio;

namespace {

using clock_type = std::chrono::steady_clock;

double us_between(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

/// Jobs wait for `open` before their item is worked (part 2 holds every job until all are in).
struct gate {
  static inline std::mutex mtx;
  static inline std::condition_variable cv;
  static inline std::atomic<bool> open{true};
  static void set(bool o) {
    std::lock_guard<std::mutex> guard{mtx};
    open = o;
    cv.notify_all();
  }
  static void wait() {
    std::unique_lock<std::mutex> lock{mtx};
    cv.wait(lock, [] { return open.load(); });
  }
};

struct squares {
  struct producer {
    std::int64_t work(std::int64_t x) {
      if (!gate::open.load()) gate::wait();
      return x * x;
    }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

using runner_type = troupe::unordered_runner<squares>;

std::vector<std::int64_t> one(std::int64_t x) {
  return {x};
}

std::vector<double> by_get(runner_type& r, int n) {
  std::vector<double> out;
  for (int i = 0; i < n; ++i) {
    auto t0 = clock_type::now();
    auto v = r.submit(std::vector<std::int64_t>{i}).get();
    out.push_back(us_between(t0, clock_type::now()));
    if (v != std::int64_t{i} * i) throw std::runtime_error("wrong result");
  }
  return out;
}

std::vector<double> by_then(runner_type& r, int n) {
  std::vector<double> out;
  for (int i = 0; i < n; ++i) {
    std::atomic<bool> done{false};
    auto t0 = clock_type::now();
    r.submit(std::vector<std::int64_t>{i}).then([&](troupe::outcome<std::int64_t> o) {
      if (!o.ok() || *o.value != std::int64_t{i} * i) std::abort();
      done.store(true, std::memory_order_release);
    });
    while (!done.load(std::memory_order_acquire)) {
    }
    out.push_back(us_between(t0, clock_type::now()));
  }
  return out;
}

/// n round trips in turn on a one-thread io_context, the caller's event loop: `start(io, x,
/// done)` submits job x and has done(value) run on the loop when it ends; each is timed from
/// submit() to done.
template <class Start>
std::vector<double> chained(int n, Start start) {
  net::io_context io;
  std::vector<double> out;
  int i = 0;
  clock_type::time_point t0;
  std::function<void()> next = [&] {
    if (i == n) return;
    t0 = clock_type::now();
    auto x = i;
    start(io, x, [&, x](std::int64_t v) {
      if (v != std::int64_t{x} * x) std::abort();
      out.push_back(us_between(t0, clock_type::now()));
      ++i;
      next();
    });
  };
  auto guard = net::make_work_guard(io);
  net::post(io, next);
  while (static_cast<int>(out.size()) < n) io.run_one();
  return out;
}

std::vector<double> by_then_post(runner_type& r, int n) {
  return chained(n, [&r](net::io_context& io, std::int64_t x, auto done) {
    r.submit(one(x)).then([&io](std::function<void()> f) { net::post(io, std::move(f)); },
                          [done](troupe::outcome<std::int64_t> o) {
                            if (!o.ok()) std::abort();
                            done(*o.value);
                          });
  });
}

/// async_get with a plain callback bound to the io_context (asio::bind_executor): then() on an
/// executor, the Asio way.
std::vector<double> by_bound_callback(runner_type& r, int n) {
  return chained(n, [&r](net::io_context& io, std::int64_t x, auto done) {
    troupe::async_get(r.submit(one(x)),
                      net::bind_executor(io, [done](std::exception_ptr e, std::int64_t v) {
                        if (e) std::abort();
                        done(v);
                      }));
  });
}

enum class loop { spins, sleeps, polls };

/// `spins`: as it comes (async_get keeps the loop's thread awake 200 us while a job is pending);
/// `sleeps`: troupe::set_completion_spin(io, 0us), so every completion wakes the thread;
/// `polls`: the event loop polls instead of sleeping (io_context::poll in a loop), as a
/// latency-bound server might.
std::vector<double> by_co_await(runner_type& r, int n, loop how) {
  net::io_context io;
  if (how == loop::sleeps) troupe::set_completion_spin(io, std::chrono::microseconds{0});
  std::vector<double> out;
  net::co_spawn(
      io,
      [&]() -> net::awaitable<void> {
        for (int i = 0; i < n; ++i) {
          auto t0 = clock_type::now();
          // (the handle made before co_await: GCC 12 rejects a braced list inside its operand)
          auto h = r.submit(one(i));
          auto v = co_await troupe::async_get(std::move(h), net::use_awaitable);
          out.push_back(us_between(t0, clock_type::now()));
          if (v != std::int64_t{i} * i) std::abort();
        }
      },
      net::detached);
  if (how == loop::polls)
    while (static_cast<int>(out.size()) < n) io.poll();
  else
    io.run();
  return out;
}

void report(const char* what, const std::vector<double>& v, double base_p50) {
  auto p50 = percentile(v, 0.5);
  std::printf("  %-28s p50 %6.1f us  p90 %6.1f us  p99 %6.1f us  p50/get %.3f\n", what, p50,
              percentile(v, 0.9), percentile(v, 0.99), base_p50 > 0 ? p50 / base_p50 : 1.0);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe_completions_bench: then / co_await against get()"};
  int round_trips = 2000, rounds = 5, concurrent = 10000;
  app.add_option("--round-trips", round_trips, "1-item jobs per way and round");
  app.add_option("--rounds", rounds, "interleaved rounds of the seven ways");
  app.add_option("--concurrent", concurrent, "jobs in flight at once in part 2");
  CLI11_PARSE(app, argc, argv);

  runner_type runner{2};
  std::printf("1. a 1-item job's round trip (2 CPU producers, %d rounds of %d each way)\n", rounds,
              round_trips);
  std::vector<double> g, t, tp, bound, co, sleeps, busy;
  by_get(runner, 200);  // warm-up
  for (int k = 0; k < rounds; ++k) {
    auto a = by_get(runner, round_trips);
    auto b = by_then(runner, round_trips);
    auto c = by_then_post(runner, round_trips);
    auto c2 = by_bound_callback(runner, round_trips);
    auto d = by_co_await(runner, round_trips, loop::spins);
    auto s = by_co_await(runner, round_trips, loop::sleeps);
    auto e = by_co_await(runner, round_trips, loop::polls);
    g.insert(g.end(), a.begin(), a.end());
    t.insert(t.end(), b.begin(), b.end());
    tp.insert(tp.end(), c.begin(), c.end());
    bound.insert(bound.end(), c2.begin(), c2.end());
    co.insert(co.end(), d.begin(), d.end());
    sleeps.insert(sleeps.end(), s.begin(), s.end());
    busy.insert(busy.end(), e.begin(), e.end());
  }
  auto base = percentile(g, 0.5);
  report("get()", g, base);
  report("then(f)", t, base);
  report("then(post to io_context, f)", tp, base);
  report("async_get, bound callback", bound, base);
  report("co_await async_get", co, base);
  report("co_await, no spin", sleeps, base);
  report("co_await, the loop polling", busy, base);

  std::printf("2. %d 1-item jobs in flight at once (held until all are submitted)\n", concurrent);
  {  // coroutines on one io_context thread
    gate::set(false);
    net::io_context io;
    std::atomic<int> left{concurrent};
    std::int64_t sum = 0;
    auto before = example::threads_now();
    auto t0 = clock_type::now();
    for (int i = 0; i < concurrent; ++i)
      net::co_spawn(
          io,
          [&, i]() -> net::awaitable<void> {
            auto h = runner.submit(one(i));
            sum += co_await troupe::async_get(std::move(h), net::use_awaitable);
            --left;
          },
          net::detached);
    int peak = before;
    io.poll();  // every coroutine has submitted and waits
    peak = std::max(peak, example::threads_now());
    gate::set(true);
    io.run();
    auto wall = us_between(t0, clock_type::now()) / 1000;
    std::printf(
        "  co_await on one thread:  %8.1f ms, threads %d before, %d at the peak, sum %lld\n", wall,
        before, peak, static_cast<long long>(sum));
  }
  {  // one blocked thread per job
    gate::set(false);
    std::atomic<std::int64_t> sum{0};
    std::atomic<int> submitted{0};
    auto before = example::threads_now();
    auto t0 = clock_type::now();
    std::vector<std::thread> callers;
    callers.reserve(static_cast<std::size_t>(concurrent));
    for (int i = 0; i < concurrent; ++i)
      callers.emplace_back([&, i] {
        auto h = runner.submit(std::vector<std::int64_t>{i});
        ++submitted;
        sum += h.get();
      });
    while (submitted.load() < concurrent) std::this_thread::yield();
    int peak = example::threads_now();
    gate::set(true);
    for (auto& c : callers) c.join();
    auto wall = us_between(t0, clock_type::now()) / 1000;
    std::printf("  a thread each in get(): %8.1f ms, threads %d before, %d at the peak, sum %lld\n",
                wall, before, peak, static_cast<long long>(sum.load()));
  }
  return 0;
}
