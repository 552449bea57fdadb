// sum_of_powers: a parameter reaches every producer through troupe::config (seed example 4).
//
//   config {power: P} ──▶ producer::work(x) = x^P ──▶ consumer: sum ──▶ result
#include <cstdint>
#include <iostream>

#include "common/cli.hpp"

struct sum_of_powers {
  struct producer {
    producer(const troupe::device&, const troupe::config& cfg)
        : power(cfg.get<int>("power")), work_ms(cfg.get_or("work_ms", 0.0)) {}
    std::int64_t work(std::int64_t x) const {
      example::simulate_work(work_ms);
      std::int64_t y = 1;
      for (int i = 0; i < power; ++i) y *= x;
      return y;
    }
    int power;
    double work_ms;
  };
  struct consumer {
    explicit consumer(const troupe::config&) {}
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};
TROUPE_REGISTER_JOB(sum_of_powers);

int main(int argc, char** argv) {
  CLI::App app{"sum_of_powers: sum of x^power over 0..items-1"};
  example::flags f;
  int power = 3;
  f.simulated_work = true;  // --work-ms
  example::add_flags(app, f);
  app.add_option("--power", power, "the exponent, passed through troupe::config");
  CLI11_PARSE(app, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;
  return example::guarded([&] {
    troupe::config cfg;
    cfg.set("power", power).set("work_ms", f.work_ms);
    std::vector<std::int64_t> inputs(f.items);
    for (std::size_t i = 0; i < inputs.size(); ++i) inputs[i] = static_cast<std::int64_t>(i);
    std::int64_t result = 0;
    auto progress = f.make_progress();  // on stderr (common/progress.hpp)
    if (f.ordered) {
      troupe::ordered_runner<sum_of_powers> runner{f.device_list(), cfg, f.options(progress)};
      auto watching = progress.watch(runner);
      result = runner.run(inputs);
    } else {
      troupe::unordered_runner<sum_of_powers> runner{f.device_list(), cfg, f.options(progress)};
      auto watching = progress.watch(runner);
      result = runner.run(inputs);
    }
    progress.finish();
    std::cout << "result: " << result << "\n";
  });
}
