// Pure parts of the training coordinator (torch/src/train.cpp): no LibTorch, no CAF, no clock.
// The fixed summation tree over shard indices (deterministic reduction), the shard planner
// (who computes which shards, by measured speed), the recovery ledger (where each shard's
// gradient is counted, exactly once) and the transport policy (plane, CAF ring, coordinator). Unit
// and property tests: tests/train_core_test.cpp and train_core_properties_test.cpp (in the core
// test binary: nothing here needs LibTorch).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace troupe::detail::train_core {

// -- the fixed summation tree --------------------------------------------------------------------
// Node (l, i) covers shards [i << l, (i + 1) << l) clipped to [0, S). Its value is its left
// child's plus its right child's, or its left child's alone when the right one covers nothing.
// Every node's value is thus one fixed expression of the leaves, whoever computes it: the sum
// of a step depends only on the shard count, not on who computed which shards.

using node_key = std::pair<int, std::uint64_t>;  ///< (level, index)

/// The root's level for `shards` shards.
inline int tree_top(std::uint64_t shards) {
  int top = 0;
  while ((std::uint64_t{1} << top) < shards) ++top;
  return top;
}

inline std::uint64_t node_begin(int l, std::uint64_t i) {
  return i << l;
}
inline std::uint64_t node_end(int l, std::uint64_t i, std::uint64_t shards) {
  return std::min(shards, (i + 1) << l);
}

namespace tree_impl {
inline void blocks(int l, std::uint64_t i, std::uint64_t a, std::uint64_t b, std::uint64_t shards,
                   std::vector<node_key>& out) {
  auto lo = node_begin(l, i), hi = node_end(l, i, shards);
  if (hi <= a || lo >= b || lo >= hi) return;
  if (a <= lo && hi <= b) {
    out.emplace_back(l, i);
    return;
  }
  blocks(l - 1, 2 * i, a, b, shards, out);
  blocks(l - 1, 2 * i + 1, a, b, shards, out);
}
}  // namespace tree_impl

/// The largest tree nodes inside [a, b), in shard order: what a replica that computed shards
/// [a, b) sends (one value per node).
inline std::vector<node_key> tree_blocks(std::uint64_t a, std::uint64_t b, std::uint64_t shards) {
  std::vector<node_key> out;
  if (shards > 0 && a < b) tree_impl::blocks(tree_top(shards), 0, a, b, shards, out);
  return out;
}

/// Node (l, i)'s value from the leaves: leaf(s) for shard s, add(x, y) -> x + y (may reuse x).
template <class V, class Leaf, class Add>
V tree_value(int l, std::uint64_t i, std::uint64_t shards, Leaf& leaf, Add& add) {
  if (l == 0) return leaf(i);
  V left = tree_value<V>(l - 1, 2 * i, shards, leaf, add);
  if (node_begin(l - 1, 2 * i + 1) >= shards) return left;
  V right = tree_value<V>(l - 1, 2 * i + 1, shards, leaf, add);
  return add(std::move(left), std::move(right));
}

/// A shard whose value is in no node the coordinator has.
struct missing_shard : std::runtime_error {
  explicit missing_shard(std::uint64_t s)
      : std::runtime_error("shard " + std::to_string(s) + "'s gradient is missing"), shard(s) {}
  std::uint64_t shard;
};

/// Node (l, i)'s value from the nodes the replicas sent (`have`), in the tree's fixed order;
/// throws missing_shard when a leaf is in none of them.
template <class V, class Add>
V tree_combine(int l, std::uint64_t i, std::uint64_t shards, std::map<node_key, V>& have,
               Add& add) {
  if (auto it = have.find({l, i}); it != have.end()) return it->second;
  if (l == 0) throw missing_shard(i);
  V left = tree_combine<V>(l - 1, 2 * i, shards, have, add);
  if (node_begin(l - 1, 2 * i + 1) >= shards) return left;
  V right = tree_combine<V>(l - 1, 2 * i + 1, shards, have, add);
  return add(std::move(left), std::move(right));
}

// -- the shard planner ---------------------------------------------------------------------------

/// Shards [a, b) for replica `who`.
struct share {
  std::size_t who = 0;
  std::uint64_t a = 0, b = 0;
  friend bool operator==(const share& x, const share& y) {
    return x.who == y.who && x.a == y.a && x.b == y.b;
  }
};

/// Splits shards [a, b) among `who` (in that order, contiguous ranges in shard order) by their
/// measured speed `rates[k]` (shards per second; 0: not measured yet, counted as the mean of
/// the measured ones, or 1 when none is). `even`: by count alone. When there are at least as
/// many shards as replicas, every replica gets at least one (a slow one is still measured).
/// Replicas whose share rounds to nothing get no entry.
inline std::vector<share> split(std::uint64_t a, std::uint64_t b,
                                const std::vector<std::size_t>& who,
                                const std::vector<double>& rates, bool even) {
  std::vector<share> out;
  if (who.empty() || b <= a) return out;
  double known = 0;
  std::size_t n_known = 0;
  for (auto r : rates)
    if (r > 0) known += r, ++n_known;
  double fallback = n_known ? known / static_cast<double>(n_known) : 1.0;
  std::vector<double> w;
  double total = 0;
  for (std::size_t k = 0; k < who.size(); ++k) {
    double r = k < rates.size() ? rates[k] : 0;
    w.push_back(even ? 1.0 : (r > 0 ? r : fallback));
    total += w.back();
  }
  const std::uint64_t each = b - a >= who.size() ? 1 : 0;
  const auto rest = static_cast<double>(b - a - each * who.size());
  double cum = 0;
  auto lo = a;
  for (std::size_t k = 0; k < who.size(); ++k) {
    cum += w[k];
    auto hi = k + 1 == who.size()
                  ? b
                  : a + each * (k + 1) + static_cast<std::uint64_t>(rest * cum / total + 0.5);
    hi = std::clamp(hi, lo, b);
    if (hi > lo) out.push_back(share{who[k], lo, hi});
    lo = hi;
  }
  return out;
}

// -- the recovery ledger -------------------------------------------------------------------------

using range = std::pair<std::uint64_t, std::uint64_t>;  ///< shards [first, second)

/// Where each shard's gradient of one step is counted, exactly once. Requests go out (`sent`);
/// an answer counts its shards at the coordinator, or, when the sums stay on the replicas until
/// a ring all-reduce (`held_by_replicas`), on the replica that answered. A replica lost gives
/// back the ranges it had in flight and, in ring mode, those it held: what to compute again.
/// An answer to a request given up on counts nothing.
class ledger {
 public:
  ledger() = default;
  ledger(std::uint64_t shards, bool held_by_replicas)
      : held_by_replicas_(held_by_replicas), counted_(shards, 0) {}

  void sent(std::uint64_t id, std::size_t who, std::uint64_t a, std::uint64_t b) {
    if (a >= b || b > counted_.size()) throw std::logic_error("ledger: a bad range");
    flight_[id] = share{who, a, b};
  }
  /// The answered request's share, its shards now counted; nullopt for a request given up on
  /// (or never sent): its answer must be ignored.
  std::optional<share> answered(std::uint64_t id) {
    auto it = flight_.find(id);
    if (it == flight_.end()) return std::nullopt;
    auto x = it->second;
    flight_.erase(it);
    for (auto s = x.a; s < x.b; ++s) counted_[s] += 1;
    if (held_by_replicas_) held_[x.who].emplace_back(x.a, x.b);
    return x;
  }
  /// A request that failed: nothing counted (the step fails).
  void failed(std::uint64_t id) { flight_.erase(id); }
  /// `who` is lost: the ranges to compute again, in shard order (each range once: a second call
  /// gives nothing).
  std::vector<range> lost(std::size_t who) {
    std::vector<range> out;
    for (auto it = flight_.begin(); it != flight_.end();) {
      if (it->second.who == who) {
        out.emplace_back(it->second.a, it->second.b);
        it = flight_.erase(it);
      } else {
        ++it;
      }
    }
    if (auto h = held_.find(who); h != held_.end()) {
      for (auto [a, b] : h->second) {
        for (auto s = a; s < b; ++s) counted_[s] -= 1;
        out.emplace_back(a, b);
      }
      held_.erase(h);
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  [[nodiscard]] bool waiting() const { return !flight_.empty(); }
  /// The requests still expected, by id.
  [[nodiscard]] const std::map<std::uint64_t, share>& in_flight() const { return flight_; }
  /// Replicas that hold sums (ring mode).
  [[nodiscard]] std::vector<std::size_t> holders() const {
    std::vector<std::size_t> out;
    for (auto& [who, ranges] : held_)
      if (!ranges.empty()) out.push_back(who);
    return out;
  }
  /// How many times shard `s` is counted now.
  [[nodiscard]] std::uint32_t count(std::uint64_t s) const { return counted_.at(s); }
  /// The first shard not counted exactly once, nullopt when the step's sum is whole.
  [[nodiscard]] std::optional<std::uint64_t> incomplete() const {
    for (std::uint64_t s = 0; s < counted_.size(); ++s)
      if (counted_[s] != 1) return s;
    return std::nullopt;
  }

 private:
  bool held_by_replicas_ = false;
  std::vector<std::uint32_t> counted_;
  std::map<std::uint64_t, share> flight_;
  std::map<std::size_t, std::vector<range>> held_;
};

// -- the transport policy ------------------------------------------------------------------------

/// How a fast-mode step's gradients are reduced, and what a ring's end teaches: over the
/// replicas' data ports (plane) → a ring through CAF → the coordinator. A ring that fails with
/// no replica lost means no route among them: rings off for good. A ring over the plane that
/// fails with none lost: the plane off (CAF's path). A ring late past replica_timeout while every
/// replica answers alone (a pause): the next `pause` steps go through the coordinator, the pause
/// doubling with every such ring (up to 256) and back to 1 after a ring that completes.
class transport_policy {
 public:
  /// Gradients at least this large, with a replica on a node, are all-reduced in a ring.
  static constexpr std::uint64_t ring_min_bytes = std::uint64_t{256} << 10;
  static constexpr std::uint64_t max_pause = 256;

  /// Whether step number `steps` (steps completed so far) reduces in a ring.
  [[nodiscard]] bool ring(std::uint64_t steps, std::size_t live, std::uint64_t grad_bytes,
                          bool any_on_a_node) const {
    return rings_ && live >= 2 && grad_bytes >= ring_min_bytes && steps >= paused_until_ &&
           any_on_a_node;
  }
  /// Whether a ring goes over the data plane (the user allows it and every member has a port).
  [[nodiscard]] bool plane(bool allowed, bool every_member_has_a_port) const {
    return plane_ && allowed && every_member_has_a_port;
  }

  enum class ring_end { done, lost, failed, timed_out, plane_failed };
  /// Decisions after a ring and the step's recomputation (when it did not complete):
  /// `lost_after` replicas lost while the step was computed again.
  enum class decision { none, rings_off, paused, plane_off };
  decision ended(ring_end e, std::uint64_t steps, bool lost_after = false) {
    switch (e) {
      case ring_end::done:
        pause_ = 1;
        return decision::none;
      case ring_end::lost:
        return decision::none;
      case ring_end::failed:
        rings_ = false;
        return decision::rings_off;
      case ring_end::timed_out:
        if (lost_after) return decision::none;  // the culprit was found and dropped
        paused_until_ = steps + 1 + pause_;
        pause_ = std::min(pause_ * 2, max_pause);
        return decision::paused;
      case ring_end::plane_failed:
        if (lost_after) return decision::none;  // a neighbour lost: the plane is fine
        plane_ = false;
        return decision::plane_off;
    }
    return decision::none;
  }
  /// Steps of the pause the last late ring began (1, 2, 4 ... 256).
  [[nodiscard]] std::uint64_t paused_until() const { return paused_until_; }
  [[nodiscard]] std::uint64_t next_pause() const { return pause_; }
  [[nodiscard]] bool rings() const { return rings_; }
  [[nodiscard]] bool plane_allowed() const { return plane_; }

 private:
  bool rings_ = true, plane_ = true;
  std::uint64_t pause_ = 1, paused_until_ = 0;
};

}  // namespace troupe::detail::train_core
