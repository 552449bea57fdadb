// The user translation unit of BENCHMARKS.md "Package": the README's job in 20 lines, compiled
// by bench/compile_time.sh against troupe's headers of two revisions.
#include <cstdint>
#include <iostream>
#include <numeric>
#include <troupe/troupe.hpp>
#include <vector>

struct sum_of_squares {
  struct producer {
    producer(const troupe::device&, const troupe::config&) {}
    std::int64_t work(std::int64_t x) { return x * x; }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

int main() {
  troupe::unordered_runner<sum_of_squares> runner{3};
  std::vector<std::int64_t> xs(100);
  std::iota(xs.begin(), xs.end(), 0);
  std::cout << "result: " << runner.run(xs) << "\n";
}
