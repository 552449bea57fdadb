// What a step's answers hold, for the two shells around the training coordinator
// (train_coordinator.hpp): data_parallel's (train_step.cpp) and the simulation's
// (train_sim_step.cpp). The attempt and its reduction, the requests' messages, the losses per
// shard, the partial sums (fast) or tree blocks (deterministic), and the update.
#pragma once

#include <algorithm>

#include "train_coordinator.hpp"
#include "train_msg.hpp"

namespace troupe::detail {

class step_sums {
 public:
  /// `next_id`: the shell's counter of ids (attempts and requests share it).
  step_sums(std::uint64_t& next_id, const batch& samples, std::uint64_t shard_size)
      : samples(samples),
        n(samples.size()),
        ss(shard_size),
        shards((n + ss - 1) / ss),
        losses(shards, 0.0),
        next_id_(next_id) {}

  /// A new attempt summed by `m` (train_io::begin_attempt): what the last one summed is void.
  std::uint64_t begin(train_core::reduce_mode m) {
    red = static_cast<reduction>(m);
    attempt = next_id_++;
    std::fill(losses.begin(), losses.end(), 0.0);
    partials.clear();
    blocks.clear();
    used.clear();
    return attempt;
  }

  /// The request for shards [a, b): with the whole batch (`whole`: shared, not copied, for a
  /// replica in this process) or the samples of those shards alone.
  [[nodiscard]] train_msg backward(std::uint64_t a, std::uint64_t b, bool whole) const {
    train_msg msg;
    msg.code = static_cast<std::uint8_t>(op::backward);
    msg.mode = static_cast<std::uint8_t>(red);
    msg.attempt = attempt;
    msg.total_shards = shards;
    msg.first_shard = a;
    msg.end_shard = b;
    msg.shard_size = ss;
    if (whole) {
      msg.samples = samples;
      msg.first_sample = 0;
    } else {
      msg.first_sample = a * ss;
      msg.samples = samples.slice(msg.first_sample, std::min(n, b * ss));
    }
    return msg;
  }

  /// An answer the coordinator takes (train_io::take): its losses and sums are the step's.
  void take(const train_msg& answer, const train_core::share& x) {
    for (std::uint64_t s = x.a; s < x.b && s - x.a < answer.losses.size(); ++s)
      losses[s] = answer.losses[s - x.a];
    if (used.size() < answer.used.size()) used.resize(answer.used.size(), 0);
    for (std::size_t i = 0; i < answer.used.size(); ++i) used[i] |= answer.used[i];
    if (red == reduction::fast) {
      if (answer.tensors.size() == 1) partials[x.a] = answer.tensors[0];
    } else if (red == reduction::deterministic) {
      for (std::size_t k = 0; k < answer.tensors.size() && 2 * k + 1 < answer.nodes.size(); ++k)
        blocks[{static_cast<int>(answer.nodes[2 * k]), answer.nodes[2 * k + 1]}] =
            answer.tensors[k];
    }
  }

  /// The sum of what was taken, in the update (train_io::reduce; fast and deterministic).
  void reduce() {
    update.tensors.push_back(red == reduction::fast
                                 ? sum_partials(partials)
                                 : tree_combine(tree_top(shards), 0, shards, blocks));
  }

  /// The update to apply (train_io::apply): summed, by the coordinator or in a ring on every
  /// replica, it is the mean over the batch; in a local step each replica's own.
  const train_msg& update_msg() {
    update.code = static_cast<std::uint8_t>(op::apply);
    update.mode = static_cast<std::uint8_t>(red);
    update.divisor = red == reduction::local ? 1.0 : static_cast<double>(n);
    update.used = used;
    return update;
  }

  /// The batch's mean loss, without the samples of replicas lost with their update.
  [[nodiscard]] double mean_loss(std::uint64_t lost_samples) const {
    double sum = 0;
    for (auto l : losses) sum += l;
    return sum / static_cast<double>(n > lost_samples ? n - lost_samples : 1);
  }

  const batch& samples;
  const std::uint64_t n, ss, shards;
  reduction red = reduction::fast;
  std::uint64_t attempt = 0;
  std::vector<double> losses;
  /// The parameters some answer taken gave a gradient (train_msg::used), or'ed.
  std::vector<std::uint8_t> used;
  std::map<std::uint64_t, at::Tensor> partials;  ///< fast: by first shard
  std::map<node_key, at::Tensor> blocks;         ///< deterministic
  train_msg update;

 private:
  std::uint64_t& next_id_;
};

/// Throws what a step throws that ended with no replica, or with a shard not counted exactly
/// once; returns for the other ends.
inline void throw_if_lost(const train_core::train_coordinator::outcome& out) {
  using end = train_core::train_coordinator::end;
  if (out.e == end::no_replica) throw node_error("no replica left: every one was lost or removed");
  if (out.e == end::every_replica_lost) throw node_error("every replica was lost during the step");
  if (out.e == end::internal) throw protocol_error(out.what);
}

/// The error of a step whose update failed on `where` (that replica is dropped); `none_left`:
/// it threw on every replica, and none is left.
inline work_error apply_failed(const std::string& where, const std::string& what,
                               bool none_left = false) {
  return work_error("replica::step() threw on " + where +
                        (none_left ? " (that replica is dropped, and no replica is left: it "
                                     "threw on every one)"
                                   : " (that replica is dropped; the others have stepped)") +
                        ": " + what,
                    0, where);
}

}  // namespace troupe::detail
