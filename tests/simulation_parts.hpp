// The helpers of the simulation tests (simulation*_test.cpp): a user's jobs (one with a planted
// bug), and a simulated cluster of four nodes.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <troupe/testing.hpp>
#include <troupe/troupe.hpp>
#include <vector>

#include "fault_points.hpp"
#include "test_jobs.hpp"

namespace {

using namespace std::chrono_literals;
using troupe::testing::simulation;

/// A user's job: the sum of squares.
using squares = test_jobs::squares;

/// A user's job with a planted bug: its consumer assumes the outputs come in input order
/// (true only under an ordered runner). It returns whether they did.
struct assumes_order {
  struct producer {
    std::int64_t work(std::int64_t x) { return x; }
  };
  struct consumer {
    void work(std::int64_t y) {
      in_order = in_order && y == next;
      ++next;
    }
    bool end() { return in_order; }
    std::int64_t next = 0;
    bool in_order = true;
  };
};

inline std::vector<std::int64_t> iota(std::int64_t n) {
  std::vector<std::int64_t> xs(static_cast<std::size_t>(n));
  std::iota(xs.begin(), xs.end(), 0);
  return xs;
}

inline std::int64_t sum_of_squares(std::int64_t n) {
  return (n - 1) * n * (2 * n - 1) / 6;
}

inline void four_nodes(simulation& sim) {
  sim.nodes({"a:1", "b:1", "c:1", "d:1"}, troupe::cpus(2));
  sim.cost_per_item(100us);
}

/// squares whose consumer can merge: nodes' producers never fold (work_chunk::fold does not
/// travel), and a simulated cluster must not either.
struct squares_with_merge {
  static inline std::atomic<int> merges{0};
  using producer = squares::producer;
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    void merge(consumer&& other) {
      ++merges;
      sum += other.sum;
    }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

}  // namespace
