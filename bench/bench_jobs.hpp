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

/// squares whose consumer can merge another's sum: local producers fold their chunks' outputs
/// into consumers of their own (docs/api.md, "Folding on the producers").
struct folded_squares {
  using producer = squares::producer;
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    void merge(consumer&& other) { sum += other.sum; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};
