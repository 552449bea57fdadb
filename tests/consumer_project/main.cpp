// A project outside troupe's tree, built against the installed package.
#include <cstdint>
#include <iostream>
#include <troupe/troupe.hpp>

struct squares {
  struct producer {
    std::int64_t work(std::int64_t x) { return x * x; }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

int main() {
  troupe::unordered_runner<squares> runner{2};
  std::cout << "result: " << runner.run({1, 2, 3}) << "\n";
}
