// Pure parts of the training coordinator (torch/src/train.cpp): no LibTorch, no CAF, no clock.
// The fixed summation tree over shard indices (deterministic reduction) and the shard planner
// (who computes which shards, by measured speed). Unit and property tests:
// tests/train_core_test.cpp (in the core test binary: nothing here needs LibTorch).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
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

}  // namespace troupe::detail::train_core
