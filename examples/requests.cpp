// requests: an application that shares one runner between several callers, as a service
// would. Five threads submit jobs at the same time to the same producers:
//   big      items*10 items, weight 1
//   urgent   10 items, weight 4, submitted while the big job runs: done long before it
//   cancel   an endless input, cancelled once its first outputs arrived
//   deadline an endless input with a 100 ms deadline
//   skip     items inputs of which every tenth is bad (work() throws): skipped and reported
// Each job's outcome and report is printed; last, `result:` the sum of the three exact jobs.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <mutex>
#include <sstream>
#include <thread>

#include "common/cli.hpp"

struct squares_service {
  struct producer {
    producer(const troupe::device&, const troupe::config& cfg)
        : work_ms(cfg.get_or("work_ms", 0.0)) {}
    std::int64_t work(std::int64_t x) {
      example::simulate_work(work_ms);
      if (x < 0) throw std::invalid_argument("a bad request: " + std::to_string(x));
      return x * x;
    }
    double work_ms;
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};
TROUPE_REGISTER_JOB(squares_service);

namespace {

using clock_type = std::chrono::steady_clock;

auto range(std::int64_t n) {
  return troupe::generate([i = std::int64_t{0}, n]() mutable -> std::optional<std::int64_t> {
    if (n >= 0 && i >= n) return std::nullopt;
    return i++;
  });
}

std::string describe(const troupe::job_report& r) {
  std::ostringstream out;
  out << r.items << " read, " << r.delivered << " delivered, " << r.failures.size() << " skipped, "
      << r.retries << " retried, " << r.redispatched << " redispatched";
  return out.str();
}

template <class Runner>
int serve_requests(Runner& runner, std::int64_t items, example::progress_display& progress) {
  std::mutex mtx;
  std::vector<std::pair<int, std::string>> lines;
  auto say = [&](int order, const std::string& s) {
    std::lock_guard<std::mutex> guard{mtx};
    lines.emplace_back(order, s);
  };
  std::int64_t big = 0, urgent = 0, skipped_sum = 0;
  std::atomic<bool> big_started{false};
  std::vector<std::thread> callers;
  // Progress on stderr shows the big job (options::on_progress would mix every job's reports).
  auto watching = progress.watch(runner);
  progress.expect(static_cast<std::uint64_t>(items * 10));
  callers.emplace_back([&] {
    troupe::job_options o;
    o.on_progress = progress.callback();
    auto h = runner.submit(range(items * 10), o);
    big_started = true;
    big = h.get();
    say(0, "big: " + std::to_string(big) + " (" + describe(h.report()) + ")");
  });
  callers.emplace_back([&] {
    while (!big_started) std::this_thread::yield();
    troupe::job_options o;
    o.weight = 4;
    auto t0 = clock_type::now();
    auto h = runner.submit(range(10), o);
    urgent = h.get();
    auto ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
    std::ostringstream out;
    out << "urgent: " << urgent << " in " << ms << " ms (" << describe(h.report()) << ")";
    say(1, out.str());
  });
  callers.emplace_back([&] {
    auto h = runner.submit(range(-1));  // endless
    while (h.progress().done == 0) std::this_thread::sleep_for(std::chrono::milliseconds{1});
    h.cancel();
    try {
      h.get();
      say(2, "cancel: not cancelled?");
    } catch (const troupe::cancelled& e) {
      say(2, std::string{"cancel: cancelled ("} + describe(h.report()) + ")");
    }
  });
  callers.emplace_back([&] {
    troupe::job_options o;
    o.deadline = std::chrono::milliseconds{100};
    auto h = runner.submit(range(-1), o);
    try {
      h.get();
      say(3, "deadline: finished?");
    } catch (const troupe::deadline_exceeded& e) {
      say(3, std::string{"deadline: "} + e.what());
    }
  });
  callers.emplace_back([&] {
    std::vector<std::int64_t> in;
    for (std::int64_t x = 0; x < items; ++x) in.push_back(x % 10 == 3 ? -x - 1 : x);
    troupe::job_options o;
    o.on_error = troupe::error_policy::skip();
    auto h = runner.submit(in, o);
    skipped_sum = h.get();
    auto r = h.report();
    std::string s = "skip: " + std::to_string(skipped_sum) + " (" + describe(r) + ")";
    if (!r.failures.empty())
      s += "; first skipped: item " + std::to_string(r.failures[0].index) + " on " +
           r.failures[0].where + ": " + r.failures[0].what;
    say(4, s);
  });
  for (auto& t : callers) t.join();
  progress.finish();
  std::sort(lines.begin(), lines.end());
  for (auto& [order, s] : lines) std::cout << s << "\n";
  auto st = runner.stats();
  std::cout << "pool: " << st.runs << " jobs ended (" << st.failed_runs
            << " cancelled, past their deadline or failed), " << st.items << " outputs consumed\n";
  std::cout << "result: " << big + urgent + skipped_sum << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "requests: several callers share one runner (submit, weights, cancel, deadline, skip)"};
  example::flags f;
  f.simulated_work = true;  // --work-ms
  example::add_flags(app, f);
  CLI11_PARSE(app, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;
  return example::guarded([&] {
    troupe::config cfg;
    cfg.set("work_ms", f.work_ms);
    auto n = static_cast<std::int64_t>(f.items);
    auto progress = f.make_progress();  // on stderr (common/progress.hpp)
    if (f.ordered) {
      troupe::ordered_runner<squares_service> runner{f.device_list(), cfg, f.options()};
      serve_requests(runner, n, progress);
    } else {
      troupe::unordered_runner<squares_service> runner{f.device_list(), cfg, f.options()};
      serve_requests(runner, n, progress);
    }
  });
}
