// The training coordinator's pure parts (torch/src/train_core.hpp: the summation tree and the
// shard planner), with no LibTorch: unit tests, and a property test over seeded schedules of a
// deterministic step in which replicas are lost before or after they answer and their shards
// are recomputed by the survivors, as trainer::step does. The values summed are expressions
// ("(0+1)+2"), so the test sees which shards a sum holds and in what order they were added.
// TROUPE_TRAIN_SEEDS=100000 runs the 100,000 of the docs; TROUPE_TRAIN_SEED=<seed> replays one.
#include "../torch/src/train_core.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>

namespace tc = troupe::detail::train_core;

namespace {

/// A value that remembers how it was summed.
struct expr {
  std::string text;
  std::multiset<std::uint64_t> shards;
};

expr leaf_expr(std::uint64_t s) {
  return expr{std::to_string(s), {s}};
}

expr add_expr(expr x, expr y) {
  x.text = "(" + x.text + "+" + y.text + ")";
  x.shards.insert(y.shards.begin(), y.shards.end());
  return x;
}

/// The no-fault sum of `shards` shards: the tree over all leaves.
expr whole(std::uint64_t shards) {
  auto leaf = [](std::uint64_t s) { return leaf_expr(s); };
  auto add = [](expr x, expr y) { return add_expr(std::move(x), std::move(y)); };
  return tc::tree_value<expr>(tc::tree_top(shards), 0, shards, leaf, add);
}

}  // namespace

TEST(TrainCore, TreeBlocksCoverARangeExactlyInShardOrder) {
  for (std::uint64_t shards = 1; shards <= 40; ++shards)
    for (std::uint64_t a = 0; a < shards; ++a)
      for (std::uint64_t b = a + 1; b <= shards; ++b) {
        auto blocks = tc::tree_blocks(a, b, shards);
        std::uint64_t at = a;
        for (auto [l, i] : blocks) {
          ASSERT_EQ(tc::node_begin(l, i), at) << shards << " [" << a << "," << b << ")";
          at = tc::node_end(l, i, shards);
        }
        ASSERT_EQ(at, b);
      }
  EXPECT_EQ(tc::tree_blocks(0, 8, 8), (std::vector<tc::node_key>{{3, 0}}));
  EXPECT_EQ(tc::tree_blocks(1, 7, 8), (std::vector<tc::node_key>{{0, 1}, {1, 1}, {1, 2}, {0, 6}}));
}

TEST(TrainCore, TheSumIsTheSameExpressionWhoeverComputesWhichShards) {
  auto leaf = [](std::uint64_t s) { return leaf_expr(s); };
  auto add = [](expr x, expr y) { return add_expr(std::move(x), std::move(y)); };
  for (std::uint64_t shards = 1; shards <= 33; ++shards) {
    auto want = whole(shards).text;
    // Every way of cutting [0, shards) into two ranges, each sent as its blocks.
    for (std::uint64_t cut = 0; cut <= shards; ++cut) {
      std::map<tc::node_key, expr> have;
      for (auto [from, to] : {std::pair{std::uint64_t{0}, cut}, std::pair{cut, shards}})
        for (auto [l, i] : tc::tree_blocks(from, to, shards))
          have[{l, i}] = tc::tree_value<expr>(l, i, shards, leaf, add);
      EXPECT_EQ(tc::tree_combine<expr>(tc::tree_top(shards), 0, shards, have, add).text, want);
    }
  }
  std::map<tc::node_key, expr> none;
  EXPECT_THROW(tc::tree_combine<expr>(2, 0, 4, none, add), tc::missing_shard);
}

TEST(TrainCore, TheSplitCoversTheRangeGivesEachReplicaOneAndFollowsSpeed) {
  EXPECT_TRUE(tc::split(0, 10, {}, {}, false).empty());
  auto even = tc::split(0, 10, {0, 1}, {0, 0}, true);
  EXPECT_EQ(even, (std::vector<tc::share>{{0, 0, 5}, {1, 5, 10}}));
  // A replica 9x faster gets about 9x the shards; the slow one still gets one.
  auto fast = tc::split(0, 100, {3, 7}, {9.0, 1.0}, false);
  ASSERT_EQ(fast.size(), 2u);
  EXPECT_NEAR(static_cast<double>(fast[0].b - fast[0].a), 90.0, 2.0);
  auto tiny = tc::split(0, 3, {0, 1, 2}, {1000.0, 1.0, 1.0}, false);
  EXPECT_EQ(tiny.size(), 3u) << "at least one shard each when there are enough";
  std::mt19937_64 rng{7};
  for (int round = 0; round < 2000; ++round) {
    std::uint64_t a = rng() % 50, b = a + 1 + rng() % 80;
    std::vector<std::size_t> who;
    std::vector<double> rates;
    for (std::size_t k = 0, n = 1 + rng() % 6; k < n; ++k) {
      who.push_back(k * 3);
      rates.push_back(rng() % 3 == 0 ? 0.0 : static_cast<double>(1 + rng() % 1000));
    }
    auto out = tc::split(a, b, who, rates, rng() % 2 == 0);
    auto at = a;
    std::set<std::size_t> seen;
    for (auto& x : out) {
      ASSERT_EQ(x.a, at);
      ASSERT_LT(x.a, x.b);
      ASSERT_TRUE(seen.insert(x.who).second) << "a replica got two ranges";
      at = x.b;
    }
    ASSERT_EQ(at, b);
    if (b - a >= who.size()) {
      ASSERT_EQ(out.size(), who.size());
    }
  }
}

// -- property test: a deterministic step under losses --------------------------------------------

namespace {

enum class planted { none, late_answer_used, no_recompute };

/// One seeded step: S shards over R replicas; replicas are lost at random moments, before or
/// after they answer; what was in flight to a lost replica is split among the survivors (as
/// trainer::step does); the coordinator combines the blocks it accepted.
std::optional<std::string> run_step(std::uint64_t seed, planted bug) {
  std::mt19937_64 rng{seed};
  const std::uint64_t shards = 1 + rng() % 48;
  const std::size_t replicas = 1 + rng() % 6;
  std::vector<double> rate(replicas);
  for (auto& r : rate) r = rng() % 4 == 0 ? 0.0 : static_cast<double>(1 + rng() % 100);
  std::vector<bool> alive(replicas, true);
  struct pending {
    std::size_t who;
    std::uint64_t a, b;
  };
  std::map<std::uint64_t, pending> waiting;              // by request id
  std::vector<std::pair<std::uint64_t, pending>> stale;  // in flight to replicas now lost
  std::map<tc::node_key, expr> have;
  std::uint64_t next_id = 1;
  std::ostringstream trace;
  auto leaf = [](std::uint64_t s) { return leaf_expr(s); };
  auto add = [](expr x, expr y) { return add_expr(std::move(x), std::move(y)); };
  auto live = [&] {
    std::vector<std::size_t> out;
    for (std::size_t k = 0; k < replicas; ++k)
      if (alive[k]) out.push_back(k);
    return out;
  };
  auto dispatch = [&](std::uint64_t a, std::uint64_t b) {
    auto who = live();
    std::vector<double> rs;
    for (auto k : who) rs.push_back(rate[k]);
    for (auto& x : tc::split(a, b, who, rs, false)) {
      trace << "send [" << x.a << "," << x.b << ") to " << x.who << "\n";
      waiting[next_id++] = pending{x.who, x.a, x.b};
    }
  };
  auto accept = [&](const pending& p) {
    for (auto [l, i] : tc::tree_blocks(p.a, p.b, shards))
      have[{l, i}] = tc::tree_value<expr>(l, i, shards, leaf, add);
  };
  dispatch(0, shards);
  int losses = 0;
  while (!waiting.empty()) {
    auto pick = std::next(waiting.begin(), static_cast<long>(rng() % waiting.size()));
    auto survivors = live().size();
    if (survivors > 1 && losses < 3 && rng() % 5 == 0) {
      // A replica is lost: what it had not answered goes to the survivors.
      auto who = pick->second.who;
      alive[who] = false;
      losses += 1;
      trace << "lose " << who << "\n";
      std::vector<pending> redo;
      for (auto i = waiting.begin(); i != waiting.end();) {
        if (i->second.who == who) {
          redo.push_back(i->second);
          stale.emplace_back(i->first, i->second);
          i = waiting.erase(i);
        } else {
          ++i;
        }
      }
      if (bug == planted::no_recompute) continue;  // wrong: its shards are never computed
      for (auto& p : redo) dispatch(p.a, p.b);
      continue;
    }
    trace << "answer [" << pick->second.a << "," << pick->second.b << ") from " << pick->second.who
          << "\n";
    accept(pick->second);
    waiting.erase(pick);
    // Now and then a lost replica's answer arrives late: it must not be used.
    if (!stale.empty() && rng() % 3 == 0) {
      auto late = stale.back();
      stale.pop_back();
      trace << "late answer [" << late.second.a << "," << late.second.b << ") from "
            << late.second.who << (bug == planted::late_answer_used ? " (used)" : " (dropped)")
            << "\n";
      if (bug == planted::late_answer_used) {
        // wrong: its sums are added to what the survivors sent
        for (auto [l, i] : tc::tree_blocks(late.second.a, late.second.b, shards)) {
          auto v = tc::tree_value<expr>(l, i, shards, leaf, add);
          auto& slot = have[{l, i}];
          slot = slot.shards.empty() ? v : add_expr(slot, v);
        }
      }
    }
  }
  expr total;
  try {
    total = tc::tree_combine<expr>(tc::tree_top(shards), 0, shards, have, add);
  } catch (const tc::missing_shard& e) {
    return std::string{e.what()} + "\n" + trace.str();
  }
  for (std::uint64_t s = 0; s < shards; ++s)
    if (total.shards.count(s) != 1)
      return "shard " + std::to_string(s) + " is in the sum " +
             std::to_string(total.shards.count(s)) + " times\n" + trace.str();
  if (total.text != whole(shards).text)
    return "the sum's tree differs from the no-fault one: " + total.text + "\n" + trace.str();
  return std::nullopt;
}

std::uint64_t train_seeds() {
  if (const char* n = std::getenv("TROUPE_TRAIN_SEEDS")) return std::strtoull(n, nullptr, 10);
  return 2'000;
}

std::optional<std::pair<std::uint64_t, std::string>> first_failure(planted bug) {
  std::uint64_t from = 0, n = train_seeds();
  if (const char* one = std::getenv("TROUPE_TRAIN_SEED")) {
    from = std::strtoull(one, nullptr, 10);
    n = from + 1;
  }
  for (auto seed = from; seed < n; ++seed)
    if (auto f = run_step(seed, bug)) return std::make_pair(seed, *f);
  return std::nullopt;
}

}  // namespace

TEST(TrainCoreProperties, EachShardIsInTheSumOnceAndTheTreeDependsOnlyOnTheShardCount) {
  auto f = first_failure(planted::none);
  EXPECT_FALSE(f) << "seed " << f->first << " (replay: TROUPE_TRAIN_SEED=" << f->first
                  << "): " << f->second;
}

TEST(TrainCoreProperties, APlantedMistakeIsCaught) {
  for (auto bug : {planted::late_answer_used, planted::no_recompute}) {
    auto f = first_failure(bug);
    EXPECT_TRUE(f) << "planted mistake " << static_cast<int>(bug) << " went unnoticed";
  }
}
