// A chunk's cut and the split policy (options::split_late_chunks), the remote cuts' table, and
// the node pool of the scheduler's indexes.
#include <gtest/gtest.h>
#include <sched.h>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/binary_deserializer.hpp>
#include <caf/binary_serializer.hpp>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <troupe/device_binding.hpp>
#include <troupe/internal/bulk.hpp>
#include <troupe/protocol.hpp>
#include <troupe/testing.hpp>

#include "test_jobs.hpp"

// -- chunk_cut and the split policy (options::split_late_chunks) ---------------------------------

#include <map>
#include <random>
#include <thread>

#include "split_policy.hpp"
#include "troupe/detail/chunk_cut.hpp"
#include "troupe/internal/remote_cuts.hpp"

TEST(RemoteCuts, ATrimBeforeTheChunkBeginsAfterItsAnswerAndBeyondTheCapIsSafe) {
  namespace rc = troupe::detail::remote_cuts;
  const std::uint64_t producer = 0xC0FFEE0001;
  // A trim for a chunk not begun yet (still in the producer's mailbox): all of it is taken,
  // and the producer finds its cut at 0 when it begins.
  EXPECT_EQ(rc::trim(producer, 2, 10, true), 0);
  auto c2 = rc::start(producer, 2, 10);
  EXPECT_EQ(c2->end(), 0u);
  EXPECT_EQ(c2->claim(4), 0u) << "nothing left to claim";
  rc::finish(producer, 2);
  // Chunk 1 was sent before chunk 2 (cut ids grow in send order): answered already.
  EXPECT_EQ(rc::trim(producer, 1, 10, true), -1);
  // A chunk being worked: the later half of what is not claimed goes.
  auto c3 = rc::start(producer, 3, 10);
  EXPECT_EQ(c3->claim(4), 4u);
  EXPECT_EQ(rc::trim(producer, 3, 10, false), 7);  // 6 unclaimed: 3 taken
  EXPECT_EQ(c3->end(), 7u);
  rc::finish(producer, 3);
  EXPECT_EQ(rc::trim(producer, 3, 10, true), -1) << "answered";
  // A hostile coordinator's trims for chunks it never sent do not grow the table past the cap.
  for (std::uint64_t id = 100; id < 3000; ++id) rc::trim(producer, id, 5, true);
  EXPECT_LE(rc::size(), 1024u);
  EXPECT_EQ(rc::trim(producer, 5000, 5, true), -1) << "past the cap: nothing taken";
  EXPECT_EQ(rc::trim(producer, 6000, 0, true), -1) << "an empty chunk";
  rc::forget(producer);
  EXPECT_EQ(rc::size(), 0u);
}

TEST(ChunkCut, ItemsClaimedAreTheProducersAndUnclaimedOnesTheSchedulers) {
  troupe::detail::chunk_cut c{10};
  EXPECT_EQ(c.claim(3), 3u);  // items 0..2 start
  auto keep = c.trim(false);  // the later half of 3..9 (7 items: 4 taken)
  ASSERT_TRUE(keep);
  EXPECT_EQ(*keep, 6u);
  EXPECT_EQ(c.claim(10), 3u);  // 3..5: the chunk ends at 6
  EXPECT_EQ(c.claim(1), 0u);
  EXPECT_FALSE(c.trim(true));  // nothing unclaimed: its producer is asked instead
  EXPECT_TRUE(c.wanted());
  c.release(4);  // it had started 3 only: 4 and 5 go back, the request is answered
  EXPECT_FALSE(c.wanted());
  EXPECT_EQ(c.next(), 4u);
  EXPECT_EQ(c.trim(true), std::optional<std::uint64_t>{4});
  EXPECT_EQ(c.claim(1), 0u);
}

TEST(ChunkCut, RacingClaimsReleasesAndTrimsLeaveEveryItemToExactlyOneSide) {
  // Two threads, as a producer and the scheduler: the producer claims grabs and, when asked,
  // gives back the part of a grab it has not started; the scheduler trims at random. Each item
  // is worked by the producer or taken by the scheduler, never both, never neither.
  for (std::uint64_t seed = 1; seed <= 300; ++seed) {
    constexpr std::uint64_t n = 5000;
    troupe::detail::chunk_cut c{n};
    std::vector<int> worked(n, 0);
    std::vector<std::pair<std::uint64_t, std::uint64_t>> taken;
    std::thread producer{[&] {
      std::mt19937_64 rng{seed};
      std::uint64_t pos = 0;
      for (;;) {
        auto g = c.claim(1 + rng() % 16);
        if (g == 0) return;
        auto until = pos + g;
        while (pos < until) {
          if (c.wanted() && rng() % 2 == 0) {
            c.release(pos);
            break;
          }
          worked[pos++] += 1;
        }
      }
    }};
    std::mt19937_64 rng{seed * 7919};
    std::uint64_t end = n;
    for (int i = 0; i < 200; ++i) {
      if (auto keep = c.trim(rng() % 4 == 0)) {
        taken.emplace_back(*keep, end);
        end = *keep;
      }
      std::this_thread::yield();
    }
    producer.join();
    for (auto [from, to] : taken)
      for (auto i = from; i < to; ++i) worked[i] += 10;
    for (std::uint64_t i = 0; i < n; ++i)
      ASSERT_TRUE(worked[i] == 1 || worked[i] == 10)
          << "seed " << seed << ": item " << i << " " << worked[i];
    EXPECT_EQ(c.end(), end);
  }
}

TEST(SplitPolicy, TheChunkWhoseUnstartedItemsTakeLongestGivesHalfOrAllOfThem) {
  using troupe::detail::split_candidate;
  split_candidate working;  // being worked: 100 items left of 1 us each
  working.position = 0;
  working.unclaimed = 100;
  working.claimed = 10;
  working.model_ns_per_item = 1000;
  working.elapsed_ns = 10000;
  split_candidate queued = working;  // queued behind another: 50 items of 3 us
  queued.position = 1;
  queued.unclaimed = 50;
  queued.claimed = 0;
  queued.model_ns_per_item = 3000;
  auto c = troupe::detail::choose_split({working, queued}, 20000);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->index, 1u);
  EXPECT_TRUE(c->all);  // behind others: all of it
  c = troupe::detail::choose_split({working}, 20000);
  ASSERT_TRUE(c);
  EXPECT_FALSE(c->all);                                           // being worked: the later half
  EXPECT_FALSE(troupe::detail::choose_split({working}, 200000));  // not worth a chunk
}

TEST(SplitPolicy, ItemsSlowerThanLearnedAreJudgedByTheirOwnPace) {
  using troupe::detail::split_candidate;
  split_candidate c;  // learned at 10 ns per item; 5 items took 2 ms: a slow patch
  c.position = 0;
  c.unclaimed = 1000;
  c.claimed = 5;
  c.model_ns_per_item = 10;
  c.elapsed_ns = 2e6;
  EXPECT_DOUBLE_EQ(troupe::detail::unclaimed_ns(c), 1000 * 4e5);
  EXPECT_TRUE(troupe::detail::choose_split({c}, 250000));
  // Every item claimed, late: its producer is asked for the ones it has not started.
  c.unclaimed = 0;
  c.expected_ns = 1e5;
  auto ask = troupe::detail::choose_split({c}, 250000);
  ASSERT_TRUE(ask);
  EXPECT_TRUE(ask->ask);
  c.elapsed_ns = 1.5e5;  // not late yet
  EXPECT_FALSE(troupe::detail::choose_split({c}, 250000));
}

TEST(SplitPolicy, AChunkQueuedBehindALateOneIsTakenWholeHoweverCheapItsItems) {
  // Its producer is stuck in the chunk ahead of it: its one cheap item would wait for ever.
  troupe::detail::split_candidate c;
  c.position = 1;
  c.unclaimed = 1;
  c.model_ns_per_item = 5000;
  EXPECT_FALSE(troupe::detail::choose_split({c}, 250000));
  c.wait_ns = 3e6;  // the chunk ahead has run 3 ms, over twice its expected time
  auto s = troupe::detail::choose_split({c}, 250000);
  ASSERT_TRUE(s);
  EXPECT_TRUE(s->all);
}

TEST(SplitPolicy, TheOnlyItemOfAChunkNotBegunStaysWhereItIs) {
  troupe::detail::split_candidate c;  // just sent to an idle producer: not worth a move
  c.position = 0;
  c.unclaimed = 1;
  c.model_ns_per_item = 1e6;
  EXPECT_FALSE(troupe::detail::choose_split({c}, 250000));
  c.unclaimed = 2;  // two: half of it goes
  auto s = troupe::detail::choose_split({c}, 250000);
  ASSERT_TRUE(s);
  EXPECT_FALSE(s->all);
}

// -- the node pool of the scheduler's indexes (node_pool.hpp) -------------------------------------

#include <algorithm>
#include <tuple>

#include "node_pool.hpp"

TEST(NodePool, ASetOnItsPoolMatchesAPlainSetThroughInsertsErasesCopiesMovesAndSwaps) {
  using key = std::tuple<double, std::size_t, std::size_t>;
  using pooled = std::set<key, std::less<key>, troupe::detail::pool_allocator<key>>;
  std::mt19937_64 rng{42};
  pooled a;
  std::set<key> want;
  for (int i = 0; i < 20000; ++i) {
    key k{static_cast<double>(rng() % 8) / 4, rng() % 100, rng() % 500};
    if (rng() % 3 == 0 && !want.empty()) {  // erase one that is there, by iterator
      auto w = want.lower_bound(k);
      if (w == want.end()) w = want.begin();
      auto it = a.find(*w);
      ASSERT_NE(it, a.end());
      a.erase(it);
      want.erase(w);
    } else {
      a.insert(k);
      want.insert(k);
    }
  }
  ASSERT_TRUE(std::equal(a.begin(), a.end(), want.begin(), want.end()));
  pooled copy = a;  // nodes of its own
#if !defined(__SANITIZE_ADDRESS__)
  EXPECT_NE(copy.get_allocator(), a.get_allocator()) << "a copy must not share the pool";
#endif
  copy.clear();
  EXPECT_TRUE(std::equal(a.begin(), a.end(), want.begin(), want.end()));
  pooled moved = std::move(a);  // takes the nodes and their pool
  EXPECT_TRUE(std::equal(moved.begin(), moved.end(), want.begin(), want.end()));
  pooled other;
  other.insert({1.0, 2, 3});
  std::swap(moved, other);
  EXPECT_EQ(moved.size(), 1u);
  EXPECT_TRUE(std::equal(other.begin(), other.end(), want.begin(), want.end()));
  other = moved;  // a copy assigned: the target keeps its own pool
  EXPECT_EQ(other.size(), 1u);
  moved.clear();
  EXPECT_EQ(other.count({1.0, 2, 3}), 1u);
}
