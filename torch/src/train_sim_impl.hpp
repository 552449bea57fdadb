// Simulated training, the simulated coordinator's state (troupe/train_simulation.hpp): its
// step, the shell around train_coordinator, is in train_sim_step.cpp; the rest in train_sim.cpp.
#pragma once

#include <chrono>
#include <iomanip>
#include <random>
#include <sstream>

#include "train_coordinator.hpp"
#include "train_replica.hpp"
#include "troupe/train_simulation.hpp"

namespace troupe::detail {

using sim_ns = std::chrono::nanoseconds;  ///< virtual time

struct sim_trainer::impl {
  using ns = sim_ns;
  struct member {
    device d;  ///< the simulated device ("a:1/cpu")
    std::unique_ptr<replica_state> st;
    bool alive = true;
    double rate = 0;  ///< shards per virtual second, as measured
    ns busy_until{0};
    double slow = 1;
    ns frozen_until{0};  ///< a freeze carried into the next step
    replica_stats rs;
  };
  struct request {
    std::size_t who = 0;
    std::uint64_t a = 0, b = 0;
    ns started{0}, done{0};
  };
  struct event {
    ns t;
    std::uint64_t seq;
    /// An answer; an update applied; a replica lost (silent past the heartbeats' limit); or its
    /// node killed (every replica on that node is lost with it).
    enum kind_t { answer, apply, ring_answer, lose_replica, kill_node } kind;
    std::uint64_t id;
    std::size_t who;
    std::string why;
    bool operator>(const event& x) const { return t != x.t ? t > x.t : seq > x.seq; }
  };

  train_options o;
  std::vector<member> members;
  std::vector<testing::step_fault> faults;
  std::vector<bool> fired;
  std::mt19937_64 rng;
  ns cost{0}, now{0};
  double jitter = 0;
  ns idle_timeout = network_limits().idle_timeout;
  std::uint64_t grad_bytes = 0;  ///< of one replica's flat gradient (from its init)
  std::ostringstream log;
  train_stats stats;
  std::uint64_t steps = 0, next_id = 1, seq = 0;

  void note(const std::string& line) {
    log << std::fixed << std::setprecision(3) << std::setw(12)
        << std::chrono::duration<double, std::milli>(now).count() << " ms  " << line << "\n";
  }
  std::vector<std::size_t> alive() const {
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < members.size(); ++i)
      if (members[i].alive) out.push_back(i);
    return out;
  }
  std::string name(std::size_t who) const { return members[who].d.str(); }

  /// The coordinator's decisions (shared with trainer::impl: train_coordinator.hpp), and the
  /// transport policy across steps.
  train_core::train_coordinator coordinator;
  struct shell;
  double step(const batch& samples, bool local);
  void average_parameters();
  void lose_node(const std::string& node, const std::string& why);
  void lose(std::size_t who, const std::string& why);
  /// The faults of this step on `who`'s node that fire at its shard `k` (1-based).
  std::vector<std::size_t> faults_at(std::size_t who, std::size_t k) const {
    std::vector<std::size_t> out;
    for (std::size_t f = 0; f < faults.size(); ++f)
      if (!fired[f] && faults[f].step == steps && faults[f].node == members[who].d.node() &&
          faults[f].shard == k)
        out.push_back(f);
    return out;
  }
};

}  // namespace troupe::detail
