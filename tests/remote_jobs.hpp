// The job that test nodes and the node tests both register (the same name in both programs).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <string>
#include <thread>
#include <troupe/troupe.hpp>
#include <vector>
#ifdef TROUPE_WITH_TORCH
#include <ATen/ATen.h>

#include <troupe/tensor.hpp>
#endif

struct remote_squares {
  struct producer {
    producer(const troupe::device&, const troupe::config& cfg)
        : sleep_us(cfg.get_or<std::int64_t>("sleep_us", 0)),
          hang_on(cfg.get_or<std::int64_t>("hang_on", -1)),
          end_marker(cfg.get_or<std::string>("end_marker", "")),
          slow_from(cfg.get_or<std::int64_t>("slow_from", -1)),
          slow_to(slow_from + cfg.get_or<std::int64_t>("slow_count", 0)),
          slow_us(cfg.get_or<std::int64_t>("slow_us", 0)),
          work_marker(cfg.get_or<std::string>("work_marker", "")) {
      if (auto dir = cfg.get_or<std::string>("init_hold_dir", ""); !dir.empty()) hold_init(dir);
      // With "second_init_marker" set, the process's second producer to be constructed waits
      // until the first has been constructed 300 ms ago, writes that file and takes a minute:
      // a test that kills the node on seeing the file kills it between two producers' init.
      auto marker = cfg.get_or<std::string>("second_init_marker", "");
      if (marker.empty()) return;
      if (constructed.fetch_add(1) == 0) {
        first_done = true;
        return;
      }
      while (!first_done) std::this_thread::sleep_for(std::chrono::milliseconds{1});
      std::this_thread::sleep_for(std::chrono::milliseconds{300});
      std::ofstream{marker} << "constructing\n";
      std::this_thread::sleep_for(std::chrono::minutes{1});
    }
    /// With "init_hold_dir" set and DIR/hold present, the constructor writes DIR/constructing
    /// and waits until DIR/hold is gone (at most a minute): a test acts while init is under way.
    static void hold_init(const std::string& dir) {
      if (!std::ifstream{dir + "/hold"}) return;
      std::ofstream{dir + "/constructing"} << "constructing\n";
      for (int i = 0; i < 60000 && std::ifstream{dir + "/hold"}; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds{1});
    }
    std::int64_t work(std::int64_t x) {
      if (!work_marker.empty()) std::ofstream{work_marker} << "working\n";  // then sleep_us
      if (sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      if (x >= slow_from && x < slow_to)  // a slow patch ("slow_from", "slow_count", "slow_us")
        std::this_thread::sleep_for(std::chrono::microseconds(slow_us));
      // Like a native call that never returns (until the node is killed): the first producer of
      // the process to get item `hang_on` is stuck; a retry elsewhere goes through.
      if (x == hang_on && !hung.exchange(true)) std::this_thread::sleep_for(std::chrono::hours{1});
      return x * x;
    }
    /// With "end_marker" set, the process's first producer::end() writes that file and takes
    /// a minute: a test kills the node on seeing it, while a drain or a close awaits end().
    void end() {
      if (end_marker.empty() || ended.exchange(true)) return;
      std::ofstream{end_marker} << "ending\n";
      std::this_thread::sleep_for(std::chrono::minutes{1});
    }
    std::int64_t sleep_us;
    std::int64_t hang_on;
    std::string end_marker;
    std::int64_t slow_from, slow_to, slow_us;
    std::string work_marker;  ///< "work_marker": written as each item starts
    static inline std::atomic<bool> hung{false};
    static inline std::atomic<int> constructed{0};
    static inline std::atomic<bool> ended{false};
    static inline std::atomic<bool> first_done{false};
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

/// The same squares, with a consumer that merges (consumer::merge): local producers fold their
/// chunks, a node's send them as before.
struct remote_folded_squares {
  using producer = remote_squares::producer;
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    void merge(consumer&& other) { sum += other.sum; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

/// A batch producer (work(span)): the same squares, one call per chunk.
struct remote_batch_squares {
  struct producer {
    std::vector<std::int64_t> work(troupe::span<const std::int64_t> xs) {
      std::vector<std::int64_t> ys;
      for (auto x : xs) ys.push_back(x * x);
      return ys;
    }
  };
  using consumer = remote_squares::consumer;
};

/// Large items (megabytes each): they cross the network as bulk fragments, both ways.
struct remote_blobs {
  struct producer {
    std::vector<std::int64_t> work(std::vector<std::int64_t> xs) {
      for (auto& x : xs) x = 3 * x + 1;
      return xs;
    }
  };
  struct consumer {
    void work(std::vector<std::int64_t> ys) { all.push_back(std::move(ys)); }
    std::vector<std::vector<std::int64_t>> end() { return std::move(all); }
    std::vector<std::vector<std::int64_t>> all;
  };
};

/// Each output is the index of the producer that made it (its constructor's third argument).
struct remote_index {
  struct producer {
    producer(const troupe::device&, const troupe::config&, std::size_t index) : index(index) {}
    std::int64_t work(std::int64_t) { return static_cast<std::int64_t>(index); }
    std::size_t index;
  };
};

#ifdef TROUPE_WITH_TORCH
/// Tensors through a node and back: doubled there.
struct remote_tensors {
  struct producer {
    at::Tensor work(const at::Tensor& t) { return t * 2; }
  };
  struct consumer {
    void work(at::Tensor t) { all.push_back(std::move(t)); }
    std::vector<at::Tensor> end() { return std::move(all); }
    std::vector<at::Tensor> all;
  };
};
#endif
