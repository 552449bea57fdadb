// The trivial job both benchmarks measure: x*x, summed by the consumer.
#pragma once

#include <cstdint>

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
