// The helpers of the training tests (train_*_test.cpp): small models and their configurations,
// a plain LibTorch loop to compare with, node processes and the signals sent to them.
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <caf/actor_system.hpp>
#include <caf/binary_serializer.hpp>
#include <caf/node_id.hpp>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <troupe/detail/introspect.hpp>
#include <troupe/detail/network.hpp>
#include <troupe/node.hpp>
#include <troupe/train_simulation.hpp>
#include <tuple>
#include <vector>

#ifdef TROUPE_TEST_METRICS
#include <troupe/metrics.hpp>
#endif

#include "common/classifier.hpp"
#include "node_process.hpp"
#include "ring_plane.hpp"
#include "test_util.hpp"
#include "train_checks.hpp"
#include "train_jobs.hpp"
#include "wire_attack.hpp"

namespace {

using example::sample;
using dp_t = troupe::data_parallel<example::classifier>;

inline troupe::config small_cfg() {
  troupe::config cfg;
  cfg.set("model.features", 8).set("model.hidden", 16).set("model.classes", 3);
  cfg.set("model.seed", 3).set("sgd.lr", 0.1).set("sgd.momentum", 0.9);
  return cfg;
}

using train_checks::expect_replicas_identical;
using train_checks::flat;
using train_checks::opts;
using train_checks::same_bits;

inline double relative_difference(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

/// The model of small_cfg() (or of a wider one) with its optimizer, trained the plain LibTorch
/// way.
struct plain_model {
  explicit plain_model(std::int64_t hidden = 16) : net{8, hidden, 3} {
    example::init_parameters(net, 3);
  }
  example::mlp_net net;
  torch::optim::SGD opt{net.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)};
  /// One step on the mean loss of `samples`.
  void step(const std::vector<sample>& samples) {
    opt.zero_grad();
    auto [x, y] = example::stack(samples, 8);
    torch::nn::functional::cross_entropy(net.forward(x), y).backward();
    opt.step();
  }
};

/// Trains `steps` batches with `devices`; returns the parameters, flattened.
inline at::Tensor trained(const std::vector<troupe::device>& devices,
                          const std::vector<std::vector<sample>>& batches, troupe::train_options o,
                          troupe::config cfg = small_cfg()) {
  dp_t dp{devices, cfg, o};
  for (auto& b : batches) dp.step(b);
  return flat(dp.parameters());
}

/// One `train --serve --devices cpu` process (the train example as a node), SIGKILLed by the
/// destructor.
class node_process : public test_util::node_process {
 public:
  node_process() : node_process(TROUPE_TRAIN_EXAMPLE, "127.0.0.1:0") {}
  /// On `serve` ("127.0.0.1:PORT"): a node that comes back on its address.
  explicit node_process(const std::string& serve) : node_process(TROUPE_TRAIN_EXAMPLE, serve) {}
  /// `program`: TROUPE_TEST_NODE for seeded_classifier's replicas.
  node_process(const char* program, const std::string& serve)
      : test_util::node_process(program, "cpu", {}, serve), program_(program) {}
  std::string device() const { return address() + "/cpu"; }
  const char* program() const { return program_; }

 private:
  const char* program_;
};

/// Sends `sig` to `node` `ms` milliseconds from now, on a thread of its own (join it).
inline std::thread signal_after(const node_process& node, int sig, int ms) {
  return std::thread{[&node, sig, ms] {
    std::this_thread::sleep_for(std::chrono::milliseconds{ms});
    node.kill(sig);
  }};
}

/// SIGKILLs the node in `a`, waits for its end, and starts a new one on `address`.
inline void restart_killed(std::optional<node_process>& a, const std::string& address) {
  a->kill(SIGKILL);
  {
    test_util::watchdog dog{std::chrono::seconds{30}, "the killed node's end"};
    while (!a->ended()) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
  auto program = a->program();
  a.reset();
  a.emplace(program, address);
}

/// Collects the warnings about an optimizer that cannot travel while it lives (a log handler).
class optimizer_warnings {
 public:
  optimizer_warnings() {
    troupe::set_log_handler([this](troupe::log_level level, const std::string& line) {
      std::lock_guard<std::mutex> guard{mtx_};
      if (level == troupe::log_level::warn && line.find("optimizer()") != std::string::npos)
        lines_.push_back(line);
    });
  }
  ~optimizer_warnings() { troupe::set_log_handler(nullptr); }
  optimizer_warnings(const optimizer_warnings&) = delete;
  optimizer_warnings& operator=(const optimizer_warnings&) = delete;
  std::vector<std::string> lines() {
    std::lock_guard<std::mutex> guard{mtx_};
    return lines_;
  }

 private:
  std::mutex mtx_;
  std::vector<std::string> lines_;
};

/// A live cluster's options that retry lost members every 200 ms and note when the node at
/// `address` rejoins; wait() waits for that.
class rejoin_watch {
 public:
  explicit rejoin_watch(std::string address) : address_(std::move(address)) {}
  troupe::cluster_options options() {
    troupe::cluster_options co;
    co.reconnect_every = std::chrono::milliseconds{200};
    co.on_change = [this](const troupe::membership_event& e) {
      std::lock_guard<std::mutex> guard{mtx_};
      if (e.what == troupe::membership_event::rejoined && e.node == address_) rejoined_ = true;
      cv_.notify_all();
    };
    return co;
  }
  void wait() {
    test_util::watchdog dog{std::chrono::seconds{60}, "the restarted node's rejoin"};
    std::unique_lock<std::mutex> lock{mtx_};
    cv_.wait(lock, [&] { return rejoined_; });
  }

 private:
  std::string address_;
  std::mutex mtx_;
  std::condition_variable cv_;
  bool rejoined_ = false;
};

}  // namespace

namespace {

/// small_cfg() with 256 hidden units: a 273 KiB gradient, all-reduced in a ring among replicas
/// on nodes (at least 256 KiB).
inline troupe::config wide_cfg() {
  auto cfg = small_cfg();
  cfg.set("model.hidden", 256);
  return cfg;
}

/// 1024 hidden units: a 4.2 MiB gradient, which replicas on nodes all-reduce in a ring.
inline troupe::config ring_cfg() {
  auto cfg = small_cfg();
  cfg.set("model.hidden", 1024);
  return cfg;
}

inline at::Tensor plain_result(const std::vector<std::vector<sample>>& batches,
                               std::int64_t hidden) {
  plain_model ref{hidden};
  for (auto& b : batches) ref.step(b);
  return flat(ref.net.parameters()).detach();
}

}  // namespace
