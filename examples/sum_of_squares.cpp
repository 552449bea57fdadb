// sum_of_squares: the seed's first example: producers square numbers, the consumer sums them.
//
//   inputs 0..N-1 ──▶ producer::work(x) = x*x (one per device) ──▶ consumer: sum ──▶ result
//   (with merge(): each local producer sums its chunk, and the consumer adds the partial sums)
#include <cstdint>
#include <ctime>
#include <iostream>

#include "common/cli.hpp"

struct sum_of_squares {
  struct producer {
    producer(const troupe::device&, const troupe::config& cfg)
        : work_ms(cfg.get_or("work_ms", 0.0)) {}
    std::int64_t work(std::int64_t x) {
      example::simulate_work(work_ms);
      return x * x;
    }
    double work_ms;
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    // Optional: local producers then fold their chunks' squares into consumers of their own,
    // and this one merges those (nodes' producers send their squares as before).
    void merge(consumer&& other) { sum += other.sum; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};
TROUPE_REGISTER_JOB(sum_of_squares);

/// The CPU time of this whole process so far (every thread), in seconds.
double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

template <class Runner>
std::int64_t run_all(Runner& runner, std::size_t n, example::progress_display& progress,
                     bool verbose) {
  auto watching = progress.watch(runner);  // per-producer shares on the progress bar
  progress.expect(n);                      // the generator's length, for the bar and the ETA
  std::int64_t i = 0;
  auto cpu0 = process_cpu_seconds();
  auto sum = runner.run(troupe::generate([&]() -> std::optional<std::int64_t> {
    if (i >= static_cast<std::int64_t>(n)) return std::nullopt;
    return i++;
  }));
  progress.finish();  // the summary line, on stderr
  if (verbose) {      // what the job cost in decisions (bench/many_nodes.sh: CPU per chunk)
    auto st = runner.stats();
    std::uint64_t chunks = 0;
    for (const auto& p : st.producers) chunks += p.chunks;
    std::cerr << "chunks: " << chunks << " answered whole, " << st.split_chunks << " split\n";
    std::cerr << "CPU of this process during the job: " << process_cpu_seconds() - cpu0 << " s\n";
  }
  return sum;
}

int main(int argc, char** argv) {
  CLI::App app{"sum_of_squares: sum of x*x over 0..items-1 on troupe producers"};
  example::flags f;
  f.simulated_work = true;  // --work-ms
  example::add_flags(app, f);
  // The sum of squares below 3,000,000 fits in 64 bits (about 9.0e18); beyond it, it would not.
  app.get_option("--items")->check(CLI::Range(std::size_t{0}, std::size_t{3'000'000}));
  CLI11_PARSE(app, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;
  return example::guarded([&] {
    troupe::config cfg;
    cfg.set("work_ms", f.work_ms);
    std::int64_t result = 0;
    auto progress = f.make_progress();
    // With --nodes alone, the runner follows the cluster: nodes restarted under the job rejoin.
    if (f.ordered) {
      auto runner = f.runner<troupe::ordered_runner<sum_of_squares>>(cfg, f.options(progress));
      result = run_all(runner, f.items, progress, f.verbose);
    } else {
      auto runner = f.runner<troupe::unordered_runner<sum_of_squares>>(cfg, f.options(progress));
      result = run_all(runner, f.items, progress, f.verbose);
    }
    std::cout << "result: " << result << "\n";
  });
}
