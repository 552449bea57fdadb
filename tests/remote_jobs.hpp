// The job that test nodes and the node tests both register (the same name in both programs).
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>
#include <troupe/troupe.hpp>

struct remote_squares {
  struct producer {
    producer(const troupe::device&, const troupe::config& cfg)
        : sleep_us(cfg.get_or<std::int64_t>("sleep_us", 0)) {}
    std::int64_t work(std::int64_t x) {
      if (sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      return x * x;
    }
    std::int64_t sleep_us;
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};
