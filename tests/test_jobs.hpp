// Small jobs shared by the tests.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <troupe/troupe.hpp>

namespace test_jobs {

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

/// No consumer: run() returns the outputs. Sleeps `sleep_us` config micros on odd items so
/// that completion order differs from input order.
struct jittery_identity {
  struct producer {
    producer(const troupe::device&, const troupe::config& cfg)
        : sleep_us(cfg.get_or<std::int64_t>("sleep_us", 0)) {}
    int work(int x) {
      if (sleep_us > 0 && x % 7 == 3)
        std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      return x;
    }
    std::int64_t sleep_us;
  };
};

inline std::atomic<int> ends{0};
inline std::atomic<int> constructed{0};

/// Each producer numbers the items it has seen across runs; the consumer counts per run.
struct stateful {
  struct producer {
    producer() { ++constructed; }
    std::int64_t work(std::int64_t) { return ++seen; }
    void end() { ++ends; }
    std::int64_t seen = 0;
  };
  struct consumer {
    explicit consumer(const troupe::config&) {}
    void work(std::int64_t y) {
      ++count;
      max_seen = std::max(max_seen, y);
    }
    std::pair<std::int64_t, std::int64_t> end() { return {count, max_seen}; }
    std::int64_t count = 0;
    std::int64_t max_seen = 0;
  };
};

/// Throws on the item equal to config "bad" (default 42).
struct throws_on_item {
  struct producer {
    producer(const troupe::device&, const troupe::config& cfg)
        : bad(cfg.get_or<std::int64_t>("bad", 42)) {}
    std::int64_t work(std::int64_t x) {
      if (x == bad) throw std::runtime_error("cannot handle " + std::to_string(x));
      return x;
    }
    std::int64_t bad;
  };
  using consumer = squares::consumer;
};

/// The consumer throws on the value 13.
struct consumer_throws {
  using producer = squares::producer;
  struct consumer {
    void work(std::int64_t y) {
      if (y == 169) throw std::logic_error("unlucky");
      sum += y;
    }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

/// The consumer's constructor throws when config "fail_consumer" is true.
struct consumer_ctor_throws {
  using producer = squares::producer;
  struct consumer {
    explicit consumer(const troupe::config& cfg) {
      if (cfg.get_or("fail_consumer", false)) throw std::runtime_error("no consumer today");
    }
    void work(std::int64_t) {}
    int end() { return 1; }
  };
};

inline std::atomic<int> init_attempts{0};
inline std::atomic<int> init_ends{0};

/// The second producer constructed throws.
struct second_init_throws {
  struct producer {
    producer() {
      if (++init_attempts == 2) throw std::runtime_error("weights not found");
    }
    std::int64_t work(std::int64_t x) { return x; }
    void end() { ++init_ends; }
  };
};

inline std::atomic<int> bad_producers{0};
/// The first producer constructed (since bad_producers was reset) throws on every item.
struct one_bad_producer {
  struct producer {
    producer() : bad(bad_producers.fetch_add(1) == 0) {}
    std::int64_t work(std::int64_t x) {
      if (bad) throw std::runtime_error("a broken device");
      return x;
    }
    bool bad;
  };
};

}  // namespace test_jobs
