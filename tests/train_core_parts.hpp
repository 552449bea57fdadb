// The training coordinator's test values (train_core*_test.cpp): sums kept as expressions, so
// that a test sees which shards a sum holds and in what order they were added.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include "../torch/src/ring_schedule.hpp"
#include "../torch/src/train_coordinator.hpp"

namespace tc = troupe::detail::train_core;

namespace {

/// A value that remembers how it was summed.
struct expr {
  std::string text;
  std::multiset<std::uint64_t> shards;
};

inline expr leaf_expr(std::uint64_t s) {
  return expr{std::to_string(s), {s}};
}

inline expr add_expr(expr x, expr y) {
  x.text = "(" + x.text + "+" + y.text + ")";
  x.shards.insert(y.shards.begin(), y.shards.end());
  return x;
}

/// The no-fault sum of `shards` shards: the tree over all leaves.
inline expr whole(std::uint64_t shards) {
  auto leaf = [](std::uint64_t s) { return leaf_expr(s); };
  auto add = [](expr x, expr y) { return add_expr(std::move(x), std::move(y)); };
  return tc::tree_value<expr>(tc::tree_top(shards), 0, shards, leaf, add);
}

/// Why the coordinator's blocks `have` are not the no-fault sum of `shards` shards (a shard
/// missing or counted twice, another tree), or nothing.
inline std::optional<std::string> wrong_sum(std::map<tc::node_key, expr>& have,
                                            std::uint64_t shards) {
  auto add = [](expr x, expr y) { return add_expr(std::move(x), std::move(y)); };
  expr total;
  try {
    total = tc::tree_combine<expr>(tc::tree_top(shards), 0, shards, have, add);
  } catch (const tc::missing_shard& e) {
    return std::string{e.what()};
  }
  for (std::uint64_t s = 0; s < shards; ++s)
    if (total.shards.count(s) != 1)
      return "shard " + std::to_string(s) + " is in the sum " +
             std::to_string(total.shards.count(s)) + " times";
  if (total.text != whole(shards).text)
    return "the sum's tree differs from the no-fault one: " + total.text;
  return std::nullopt;
}

}  // namespace
