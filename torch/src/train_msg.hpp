// Data-parallel training: what the coordinator (train_*.cpp) and its replicas (train_replica*.cpp)
// share: their message, the fixed summation tree on tensors, and the replica's entry points.
#pragma once

#include <ATen/ATen.h>

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "train_core.hpp"
#include "troupe/protocol.hpp"
#include "troupe/train.hpp"

namespace troupe::detail {

using clock = std::chrono::steady_clock;

enum class op : std::uint8_t {
  init,
  backward,
  apply,
  get_params,
  set_params,
  get_state,
  set_state,
};
/// fast: a partial sum per replica, summed by the coordinator; ring: partial sums kept by the
/// replicas and all-reduced among them in a ring (replicas on nodes, large gradients);
/// deterministic: a fixed tree over shard indices; local: every replica steps on its own.
enum class reduction : std::uint8_t { fast, deterministic, local, ring };

/// One command to a replica, or its answer (but init's: init_reply).
struct train_msg {
  std::uint8_t code = 0;      ///< op
  std::uint8_t mode = 0;      ///< reduction (backward, apply)
  std::uint64_t attempt = 0;  ///< backward: the coordinator's id of this attempt at a step
  std::uint64_t total_shards = 0;
  std::uint64_t first_shard = 0;
  std::uint64_t end_shard = 0;
  std::uint64_t shard_size = 0;
  std::uint64_t first_sample = 0;  ///< global index of samples[0]
  batch samples;
  std::vector<at::Tensor> tensors;   ///< gradients, parameters, a state archive (bytes)
  std::vector<std::uint64_t> nodes;  ///< deterministic: (level, index) of each gradient tensor
  std::vector<double> losses;        ///< per shard
  std::int64_t busy_ns = 0;
  double divisor = 1;  ///< apply: the gradient is the sum divided by this (on the replica)
  /// backward's answer: per parameter tensor, 1 where the request's shards gave it a gradient;
  /// apply: the same over every answer of the step (a 0 gets no gradient, as a parameter no
  /// sample of the batch used gets none in a plain loop). Empty: every one.
  std::vector<std::uint8_t> used;
};

/// A replica's answer to init (op::init): what the coordinator keeps of it.
struct init_reply {
  std::string device;            ///< where the replica runs
  std::uint64_t grad_bytes = 0;  ///< of the replica's flat gradient
  std::uint16_t data_port = 0;   ///< where its left ring neighbour connects; 0: through CAF
  bool carries_state = true;     ///< its optimizer's state travels (optimizer() or save/load)
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, init_reply& x) {
  return f(caf::meta::type_name("troupe.init_reply"), x.device, x.grad_bytes, x.data_port,
           x.carries_state);
}

/// A piece of ring all-reduce data, to the right neighbour: hop `hop` of piece `piece` of ring
/// `ring` (ring_schedule.hpp says which chunk it is). Sent as the one item of a work_chunk.
struct ring_chunk {
  std::uint64_t ring = 0;
  std::uint32_t piece = 0, hop = 0;
  at::Tensor data;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, ring_chunk& x) {
  return f(caf::meta::type_name("troupe.ring_chunk"), x.ring, x.piece, x.hop, x.data);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, train_msg& x) {
  return f(caf::meta::type_name("troupe.train_msg"), x.code, x.mode, x.attempt, x.total_shards,
           x.first_shard, x.end_shard, x.shard_size, x.first_sample, x.samples, x.tensors, x.nodes,
           x.losses, x.busy_ns, x.divisor, x.used);
}

// -- the fixed summation tree over shard indices (train_core.hpp), on tensors --------------------

using train_core::node_key;
using train_core::tree_top;

/// Fast mode's sum: the replicas' partial sums added in shard order, into the first (the
/// replica's answer, the coordinator's own now).
inline at::Tensor sum_partials(const std::map<std::uint64_t, at::Tensor>& partials) {
  at::Tensor total;
  for (auto& [first, t] : partials) {
    if (total.defined())
      total.add_(t);
    else
      total = t;
  }
  return total;
}

/// The mean of the replicas' parameters, one vector per replica in device order: the first
/// one's plus the others' in that order, divided by their number. data_parallel's and the
/// simulation's average_parameters(), so that both give the same bits.
inline std::vector<at::Tensor> mean_parameters(const std::vector<std::vector<at::Tensor>>& each) {
  std::vector<at::Tensor> mean;
  for (auto& params : each) {
    if (mean.empty()) {
      for (auto& t : params) mean.push_back(t.detach().clone());
    } else {
      for (std::size_t k = 0; k < mean.size() && k < params.size(); ++k)
        mean[k].add_(params[k].detach());
    }
  }
  for (auto& t : mean) t.div_(static_cast<double>(each.size()));
  return mean;
}

/// Throws protocol_error unless the ledger counts every shard of the step exactly once.
inline void require_whole(const train_core::ledger& book) {
  if (auto s = book.incomplete())
    throw protocol_error("internal: shard " + std::to_string(*s) + " of the step is counted " +
                         std::to_string(book.count(*s)) + " times");
}

/// Adds y into x (x is the caller's to reuse).
inline at::Tensor add_into(at::Tensor x, at::Tensor y) {
  return x.add_(y);
}

/// The largest tree nodes inside [a, b), computed in shard order, for the coordinator.
template <class Leaf>
void tree_blocks(std::uint64_t a, std::uint64_t b, std::uint64_t shards, Leaf& leaf,
                 train_msg& out) {
  auto add = &add_into;
  for (auto [l, i] : train_core::tree_blocks(a, b, shards)) {
    out.tensors.push_back(train_core::tree_value<at::Tensor>(l, i, shards, leaf, add).cpu());
    out.nodes.push_back(static_cast<std::uint64_t>(l));
    out.nodes.push_back(i);
  }
}

inline at::Tensor tree_combine(int l, std::uint64_t i, std::uint64_t shards,
                               std::map<node_key, at::Tensor>& have) {
  auto add = &add_into;
  try {
    return train_core::tree_combine<at::Tensor>(l, i, shards, have, add);
  } catch (const train_core::missing_shard& e) {
    throw protocol_error(e.what());
  }
}

// -- the replica actor (train_replica*.cpp) -------------------------------------------------------

/// The tensors `xs`, flattened and concatenated into one.
at::Tensor flat(const std::vector<at::Tensor>& xs);
/// A byte tensor holding `s`.
at::Tensor bytes_tensor(const std::string& s);
/// Spawns a replica actor for device `d` of this process (detached: a thread of its own).
caf::actor spawn_replica(caf::actor_system& sys, const device& d, const config& cfg,
                         replica_maker make);

}  // namespace troupe::detail
