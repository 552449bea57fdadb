// The training coordinator's pure parts (torch/src/train_core.hpp: the summation tree and the
// shard planner), with no LibTorch: unit tests, and a property test over seeded schedules of a
// deterministic step in which replicas are lost before or after they answer and their shards
// are recomputed by the survivors, as trainer::step does. The values summed are expressions
// ("(0+1)+2"), so the test sees which shards a sum holds and in what order they were added.
// TROUPE_TRAIN_SEEDS=100000 runs the 100,000 of the docs; TROUPE_TRAIN_SEED=<seed> replays one.
#include "train_core_parts.hpp"

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

TEST(TrainCore, TheLedgerCountsEachShardOnceAndGivesBackWhatALostReplicaHad) {
  tc::ledger book{8, false};  // sums at the coordinator
  book.sent(1, 0, 0, 4);
  book.sent(2, 1, 4, 8);
  EXPECT_THROW(book.sent(3, 0, 6, 9), std::logic_error);
  EXPECT_EQ(book.answered(1), (tc::share{0, 0, 4}));
  EXPECT_EQ(book.count(0), 1u);
  EXPECT_EQ(book.incomplete(), std::optional<std::uint64_t>{4});
  EXPECT_EQ(book.lost(1), (std::vector<tc::range>{{4, 8}}));
  EXPECT_TRUE(book.lost(1).empty()) << "a range is given back once";
  EXPECT_FALSE(book.answered(2)) << "an answer to a request given up on counts nothing";
  EXPECT_EQ(book.count(5), 0u);
  EXPECT_TRUE(book.lost(0).empty()) << "what reached the coordinator stays counted";
  book.sent(3, 0, 4, 6);
  book.sent(4, 2, 6, 8);
  book.failed(4);
  EXPECT_FALSE(book.answered(4));
  EXPECT_TRUE(book.answered(3));
  EXPECT_EQ(book.incomplete(), std::optional<std::uint64_t>{6});
  book.sent(5, 0, 6, 8);
  EXPECT_TRUE(book.answered(5));
  EXPECT_FALSE(book.incomplete());
  EXPECT_FALSE(book.waiting());
  // A shard computed twice is seen.
  book.sent(6, 0, 0, 1);
  EXPECT_TRUE(book.answered(6));
  EXPECT_EQ(book.incomplete(), std::optional<std::uint64_t>{0});
  EXPECT_EQ(book.count(0), 2u);

  tc::ledger ring{6, true};  // ring mode: sums stay on the replicas
  ring.sent(1, 0, 0, 2);
  ring.sent(2, 1, 2, 4);
  ring.sent(3, 1, 4, 6);
  EXPECT_TRUE(ring.answered(1));
  EXPECT_TRUE(ring.answered(2));
  EXPECT_EQ(ring.holders(), (std::vector<std::size_t>{0, 1}));
  EXPECT_EQ(ring.lost(1), (std::vector<tc::range>{{2, 4}, {4, 6}}))
      << "what it held and what it had in flight, in shard order";
  EXPECT_EQ(ring.count(2), 0u);
  EXPECT_EQ(ring.holders(), (std::vector<std::size_t>{0}));
  EXPECT_FALSE(ring.answered(3));
}

TEST(TrainCore, TheTransportPolicyFallsBackAndPausesLateRings) {
  using ring_end = tc::transport_policy::ring_end;
  using decision = tc::transport_policy::decision;
  constexpr auto big = tc::transport_policy::ring_min_bytes;
  tc::transport_policy t;
  EXPECT_TRUE(t.ring(0, 2, big, true));
  EXPECT_FALSE(t.ring(0, 1, big, true)) << "one replica";
  EXPECT_FALSE(t.ring(0, 2, big - 1, true)) << "small gradients";
  EXPECT_FALSE(t.ring(0, 2, big, false)) << "every replica in this process";
  EXPECT_TRUE(t.plane(true, true));
  EXPECT_FALSE(t.plane(false, true)) << "direct_ring = false";
  EXPECT_FALSE(t.plane(true, false)) << "a member without a port";
  // A ring over the plane that failed because a neighbour was lost: the plane stays.
  EXPECT_EQ(t.ended(ring_end::plane_failed, 0, true), decision::none);
  EXPECT_TRUE(t.plane(true, true));
  EXPECT_EQ(t.ended(ring_end::plane_failed, 0, false), decision::plane_off);
  EXPECT_FALSE(t.plane(true, true));
  EXPECT_TRUE(t.ring(0, 2, big, true)) << "rings go on through CAF";
  // Late rings with no loss: pauses of 1, 2, 4 ... 256 steps; a ring that completes resets it.
  EXPECT_EQ(t.ended(ring_end::timed_out, 5, true), decision::none) << "the culprit was dropped";
  EXPECT_TRUE(t.ring(5, 2, big, true));
  std::uint64_t step = 5;
  for (std::uint64_t pause : {1, 2, 4, 8, 16, 32, 64, 128, 256, 256}) {
    EXPECT_EQ(t.ended(ring_end::timed_out, step, false), decision::paused);
    EXPECT_EQ(t.paused_until(), step + 1 + pause);
    EXPECT_FALSE(t.ring(step + pause, 2, big, true));
    step = t.paused_until();
    EXPECT_TRUE(t.ring(step, 2, big, true));
  }
  EXPECT_EQ(t.ended(ring_end::done, step), decision::none);
  EXPECT_EQ(t.next_pause(), 1u);
  EXPECT_EQ(t.ended(ring_end::lost, step), decision::none);
  EXPECT_TRUE(t.ring(step, 2, big, true));
  // A ring that fails while every replica answers: no route among them, rings off for good.
  EXPECT_EQ(t.ended(ring_end::failed, step), decision::rings_off);
  EXPECT_FALSE(t.ring(step + 1000, 2, big, true));
}

// -- the ring all-reduce's schedule (ring_schedule.hpp), shared by both transports -------------

TEST(TrainCore, TheFirstStepThatReducesAfterLocalStepsStartsFromOneState) {
  // data_parallel and the simulation both ask the coordinator before each step; the shell then
  // copies the first live replica's state to the others.
  tc::train_coordinator c;
  EXPECT_FALSE(c.sync_before(false));  // nothing stepped apart yet
  EXPECT_FALSE(c.sync_before(true));   // local steps: each replica on its own
  EXPECT_FALSE(c.sync_before(true));
  EXPECT_TRUE(c.sync_before(false));   // the next reducing step: copy first
  EXPECT_FALSE(c.sync_before(false));  // once
  EXPECT_FALSE(c.sync_before(true));
  c.states_equal();  // load() made them equal
  EXPECT_FALSE(c.sync_before(false));
}

TEST(TrainCore, TheRingScheduleLeavesEveryMemberWithTheSameSumOfEveryChunk) {
  namespace rp = troupe::detail::ring_plane;
  for (std::uint32_t n = 2; n <= 9; ++n) {
    // value[m][k]: member m's chunk k, as an expression of the members' own chunks.
    std::vector<std::vector<expr>> value(n, std::vector<expr>(n));
    for (std::uint32_t m = 0; m < n; ++m)
      for (std::uint32_t k = 0; k < n; ++k) value[m][k] = leaf_expr(m);
    const auto hops = rp::schedule{n, 0}.hops();
    for (std::uint32_t h = 0; h < hops; ++h) {
      // Every member sends at once what it holds after the last hop.
      std::vector<std::pair<std::uint32_t, expr>> out(n);
      for (std::uint32_t m = 0; m < n; ++m) {
        auto k = rp::schedule{n, m}.sent(h);
        out[m] = {k, value[m][k]};
      }
      for (std::uint32_t m = 0; m < n; ++m) {
        const rp::schedule plan{n, m};
        auto& [k, v] = out[(m + n - 1) % n];  // from the left
        ASSERT_EQ(plan.received(h), k) << n << " members, hop " << h << ", member " << m;
        value[m][k] = plan.adds(h) ? add_expr(value[m][k], v) : v;
      }
    }
    for (std::uint32_t k = 0; k < n; ++k) {
      // Summed in ring order from member k: ((x_k + x_k+1) + x_k+2) ...
      auto want = leaf_expr(k);
      for (std::uint32_t j = 1; j < n; ++j) want = add_expr(leaf_expr((k + j) % n), want);
      for (std::uint32_t m = 0; m < n; ++m) {
        EXPECT_EQ(value[m][k].text, want.text) << n << " members, chunk " << k << ", member " << m;
        for (std::uint32_t x = 0; x < n; ++x) EXPECT_EQ(value[m][k].shards.count(x), 1u);
      }
    }
    // Pieces and chunks cover a buffer exactly, in order.
    for (std::int64_t numel : {0, 1, 7, 1000}) {
      for (std::uint32_t pieces : {1u, 3u, 8u}) {
        std::int64_t at = 0;
        for (std::uint32_t p = 0; p < pieces; ++p)
          for (std::uint32_t k = 0; k < n; ++k) {
            auto [b, e] = rp::chunk_range(numel, pieces, n, p, k);
            EXPECT_EQ(b, at);
            EXPECT_LE(b, e);
            at = e;
          }
        EXPECT_EQ(at, numel);
      }
    }
  }
}
