// The chunk sizer's cost model per job and producer (producer_model.hpp, docs/api.md "The
// chunk sizer's cost model"): slow start, batch producers' fixed cost, remote chunks, shrinking;
// and what it learns from: a CPU producer's busy time, without its waits for a CPU.
#include "producer_model.hpp"

#include <gtest/gtest.h>
#include <sched.h>

#include <atomic>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/binary_deserializer.hpp>
#include <caf/binary_serializer.hpp>
#include <chrono>
#include <ctime>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <troupe/device_binding.hpp>
#include <troupe/internal/bulk.hpp>
#include <troupe/protocol.hpp>
#include <troupe/testing.hpp>

#include "run_delay.hpp"
#include "test_jobs.hpp"

namespace {

using troupe::detail::model_settings;
using troupe::detail::producer_model;
using troupe::detail::sent_chunk;

sent_chunk chunk_of(std::size_t items, std::size_t behind = 0, std::size_t bytes = 8) {
  sent_chunk c;
  c.items = items;
  c.behind = behind;
  c.bytes = bytes;
  return c;
}

}  // namespace

TEST(ProducerModel, ChunksGrowTowardTheTargetTimeAtMostFourfoldPerAnswer) {
  model_settings s;  // 2 ms per chunk
  producer_model m{true, s};
  EXPECT_EQ(m.chunk_limit(s), 1u);
  m.learn(chunk_of(1), 1000, 0, true, s);  // 1 us per item: 2000 items wanted
  EXPECT_EQ(m.ns_per_item, 1000);
  EXPECT_EQ(m.chunk_items, 4u);  // x4 at most
  m.learn(chunk_of(4), 4000, 0, true, s);
  EXPECT_EQ(m.chunk_items, 16u);
  for (int i = 0; i < 10; ++i) m.learn(chunk_of(m.chunk_items), 1000 * m.chunk_items, 0, true, s);
  EXPECT_EQ(m.chunk_items, 2000u);
  // Slower items: the chunk shrinks at once (the average moves halfway).
  m.learn(chunk_of(2000), 2000 * 3000, 0, true, s);
  EXPECT_EQ(m.ns_per_item, 2000);
  EXPECT_EQ(m.chunk_items, 1000u);
  // A failed chunk teaches nothing; fixed sizes and max_in_flight bound it.
  m.learn(chunk_of(1000), 1, 0, false, s);
  EXPECT_EQ(m.chunk_items, 1000u);
  s.max_in_flight = 300;
  EXPECT_EQ(m.chunk_limit(s), 300u);
  s.chunk_size = 7;
  EXPECT_EQ(m.chunk_limit(s), 7u);
}

namespace {

sent_chunk chunk_of_job(std::uint64_t job, std::size_t items) {
  auto c = chunk_of(items);
  c.job = job;
  return c;
}

/// Answers `job`'s chunks at the producer's chunk_limit, each taking `ns(items)`, `n` times.
template <class Cost>
void answer(producer_model& m, const model_settings& s, std::uint64_t job, int n, Cost ns) {
  for (int i = 0; i < n; ++i) {
    auto items = m.chunk_limit(s, job);
    m.learn(chunk_of_job(job, items), static_cast<std::int64_t>(ns(items)), 0, true, s);
  }
}

}  // namespace

TEST(ProducerModel, AJobNotSeenYetStartsOnOneItemAndIsSizedFromItsOwnAnswersOnly) {
  model_settings s;  // 2 ms per chunk
  producer_model m{true, s};
  answer(m, s, 1, 12, [](std::size_t n) { return 10.0 * static_cast<double>(n); });  // 10 ns
  EXPECT_EQ(m.chunk_limit(s, 1), 65536u);  // max_chunk_items (200,000 wanted)
  // A job of 200 us items after it: one item at first, never 65,536 of them.
  EXPECT_EQ(m.chunk_limit(s, 2), 1u);
  answer(m, s, 2, 1, [](std::size_t n) { return 200'000.0 * static_cast<double>(n); });
  EXPECT_EQ(m.chunk_limit(s, 2), 4u);  // x4 at most per answer
  answer(m, s, 2, 4, [](std::size_t n) { return 200'000.0 * static_cast<double>(n); });
  EXPECT_NEAR(static_cast<double>(m.chunk_limit(s, 2)), 10, 1);  // 2 ms of 200 us items
  EXPECT_EQ(m.chunk_limit(s, 1), 65536u) << "each job keeps its own model";
  EXPECT_NEAR(m.chunk_ns_of(2, 10), 2'000'000, 1000);
  m.forget(2);
  EXPECT_EQ(m.chunk_limit(s, 2), 1u);
  s.chunk_size = 7;  // a fixed size wins
  EXPECT_EQ(m.chunk_limit(s, 3), 7u);
}

TEST(ProducerModel, ABatchProducersFixedCostPerCallMakesItsBatchesGrow) {
  // 2 ms per call + 10 us per item (a forward pass): per item, a call of one item looks like
  // 2 ms per item, and chunks would stay at one item. Fitted as a + b·n, they grow until the
  // fixed cost is a tenth of the call, within 8 times the target: (16 ms - 2 ms) / 10 us =
  // 1,400 items.
  model_settings s;
  producer_model m{true, s};
  auto call = [](std::size_t n) { return 2'000'000.0 + 10'000.0 * static_cast<double>(n); };
  answer(m, s, 1, 12, call);
  EXPECT_NEAR(static_cast<double>(m.chunk_limit(s, 1)), 1400, 2);
  auto [a, b] = m.rate(1)->cost();
  EXPECT_NEAR(a, 2'000'000, 1000);
  EXPECT_NEAR(b, 10'000, 10);
  // A plain producer (no fixed cost) is sized as before: the target time's worth.
  answer(m, s, 2, 12, [](std::size_t n) { return 1000.0 * static_cast<double>(n); });
  EXPECT_NEAR(static_cast<double>(m.chunk_limit(s, 2)), 2000, 2);
}

TEST(ProducerModel, ABatchProducersBatchesGoToFullSizeOnceTwoSizesShowItsCostIsMostlyFixed) {
  // 2 ms per call + 10 us per item: a call of 1 item takes 2.01 ms, one of 2 takes 2.02 ms.
  // Growing 4x per answer from one item took 7 calls to reach full batches (a short run's
  // items were gone by then), growing until the call's time doubled (at most 16x) 5; once two
  // sizes answered show the cost is mostly per call, the next batch is the target's size.
  model_settings s;
  producer_model m{true, s};
  auto call = [](std::size_t n) { return 2'000'000.0 + 10'000.0 * static_cast<double>(n); };
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 4; ++i) {
    sizes.push_back(m.chunk_limit(s, 1));
    answer(m, s, 1, 1, call);
  }
  // 1, then 2 (one size seen: twice the items), then full size: (16 ms - 2 ms) / 10 us.
  EXPECT_EQ(sizes[0], 1u);
  EXPECT_EQ(sizes[1], 2u);
  EXPECT_NEAR(static_cast<double>(sizes[2]), 1400, 2);
  EXPECT_NEAR(static_cast<double>(m.chunk_limit(s, 1)), 1400, 2);
  // A remote producer keeps growing at most 16x per answer (its fixed cost may be a thread
  // woken late on a loaded machine, not the call's), and a plain producer's items are its cost.
  producer_model far{false, s};
  sizes.clear();
  for (int i = 0; i < 4; ++i) {
    sizes.push_back(far.chunk_limit(s, 1));
    answer(far, s, 1, 1, call);
  }
  EXPECT_EQ(sizes[2], 16 * sizes[1]);
  EXPECT_LE(sizes[3], 16 * sizes[2]);
  producer_model plain{true, s};
  answer(plain, s, 1, 3,
         [](std::size_t n) { return 50'000.0 + 200'000.0 * static_cast<double>(n); });
  EXPECT_FALSE(plain.rate(1)->mostly_fixed(2e6)) << "items cost more than the call";
}

TEST(ProducerModel, ABatchProducerWhoseCallAloneOutlastsEightTargetsStillBatches) {
  // 200 ms per call + 5 ms per item (a large model's forward pass, against a 2 ms target): every
  // call outlasts 8 times the target whatever its size, and calls were kept at one item (205 ms
  // an item, where 40 items in a call take 10 ms each). Twice the fixed cost now: 40 items. The
  // first answers are of 1 and 8 items, as the scheduler sends a new job's first two chunks.
  auto call = [](std::size_t n) { return 200e6 + 5e6 * static_cast<double>(n); };
  auto sized = [&](model_settings s) {
    producer_model m{true, s};
    for (std::size_t n : {1, 8})
      m.learn(chunk_of_job(1, n), static_cast<std::int64_t>(call(n)), 0, true, s);
    answer(m, s, 1, 10, call);
    return m.chunk_limit(s, 1);
  };
  model_settings s;
  EXPECT_NEAR(static_cast<double>(sized(s)), 40, 1);
  // Within a quarter of work_timeout: a healthy producer is never given up on. At 1 s, 250 ms
  // calls (10 items); at 300 ms the bound is below the fixed cost: one item a call, as before.
  s.work_timeout = std::chrono::seconds{1};
  EXPECT_NEAR(static_cast<double>(sized(s)), 10, 1);
  s.work_timeout = std::chrono::milliseconds{300};
  EXPECT_EQ(sized(s), 1u);
}

TEST(ProducerModel, TwoOneItemChunksAtTheTargetDoNotKeepABatchProducerAtOneItem) {
  // Two one-item chunks answered at about the target (a call's fixed cost; a job's first two
  // chunks were of one item each before the second held two): after the first the next size is
  // 2, and the second answer (still one size seen) must not bring it back to 1 (it did: the
  // probe compared the 2 planned items, not the 1 answered, with twice the target); it asks for
  // twice what is planned.
  model_settings s;  // 2 ms
  producer_model m{true, s};
  m.learn(chunk_of_job(1, 1), 2'030'000, 0, true, s);
  EXPECT_EQ(m.chunk_limit(s, 1), 2u);
  m.learn(chunk_of_job(1, 1), 2'030'000, 0, true, s);  // the other queued one-item chunk
  EXPECT_EQ(m.chunk_limit(s, 1), 4u);
  m.learn(chunk_of_job(1, 2), 2'050'000, 0, true, s);  // 2 items barely longer: fixed cost
  EXPECT_GE(m.chunk_limit(s, 1), 16u);
}

TEST(ProducerModel, AJobsFirstAnswerSizesItsNextChunkFromTheBiggestOneSentAlready) {
  // The scheduler queues a job's second chunk at twice the first's size before any answer: the
  // first answer (one item at the target) asks for twice that, not for the two items already
  // under way.
  model_settings s;
  producer_model m{true, s};
  m.outstanding.push_back(chunk_of_job(1, 1));
  m.outstanding.push_back(chunk_of_job(1, 2));
  m.learn(m.outstanding.front(), 2'010'000, 0, true, s);
  EXPECT_EQ(m.chunk_limit(s, 1), 4u);
}

TEST(ProducerModel, ARemoteProducersChunksAimAtEightTimesTheTarget) {
  // Each remote chunk costs the coordinator a message and its answer: 2 ms items go 8 at a time
  // to a node (16 ms), one at a time to a local producer.
  model_settings s;
  producer_model local{true, s}, far{false, s};
  auto item = [](std::size_t n) { return 2'000'000.0 * static_cast<double>(n); };
  answer(local, s, 1, 8, item);
  answer(far, s, 1, 8, item);
  EXPECT_EQ(local.chunk_limit(s, 1), 1u);
  EXPECT_EQ(far.chunk_limit(s, 1), 8u);
  // Up to 32 producers on nodes; then 0.5 ms per producer on nodes, so that their chunks
  // together take at most a tenth of the coordinator's core: 64 ms with 128, 0.5 s with 1,000.
  for (auto [remote, items] :
       {std::pair<std::size_t, std::size_t>{32, 8}, {128, 32}, {1000, 250}}) {
    s.remote_producers = remote;
    producer_model l{true, s}, f{false, s};
    answer(l, s, 1, 12, item);
    answer(f, s, 1, 12, item);
    EXPECT_EQ(l.chunk_limit(s, 1), 1u) << remote << " producers on nodes";
    EXPECT_EQ(f.chunk_limit(s, 1), items) << remote << " producers on nodes";
  }
  // Under a work_timeout, a quarter of it at most (a healthy node is not given up on), never
  // below 8 times the target: 100 ms, 25 ms of 2 ms items; 40 ms, 16 ms.
  for (auto [timeout_ms, items] : {std::pair<int, std::size_t>{100, 12}, {40, 8}}) {
    s.work_timeout = std::chrono::milliseconds{timeout_ms};
    producer_model f{false, s};
    answer(f, s, 1, 12, item);
    EXPECT_EQ(f.chunk_limit(s, 1), items) << "work_timeout " << timeout_ms << " ms";
  }
}

TEST(ProducerModel, ChunksOfNearlyOneSizeWithNoisyTimesDoNotReadAsAFixedCost) {
  // A node's chunks of 2 ms items, 6 to 8 at a time, on a loaded machine: their times vary by
  // a few milliseconds whatever their size. A line through them is a "fixed cost" of ~14 ms
  // and a cost per item near 0, and the chunks grew 7, 14, 28, 56, 896 items (1.9 s of work
  // in one chunk at a job's tail, with 128 node processes). Sizes this close tell no line: the
  // cost stays per item and the chunks stay at 8.
  model_settings s;
  producer_model far{false, s};
  const std::vector<std::pair<std::size_t, double>> answers{
      {7, 15e6}, {7, 16e6}, {6, 17e6}, {7, 11e6}, {8, 13e6}, {7, 18e6}, {6, 12e6}, {8, 14e6}};
  for (auto [n, t] : answers)
    far.learn(chunk_of_job(1, n), static_cast<std::int64_t>(t), 0, true, s);
  EXPECT_LE(far.chunk_limit(s, 1), 16u) << "chunks of about 2 ms items aimed at 16 ms";
  EXPECT_GE(far.chunk_limit(s, 1), 6u);
}

TEST(ProducerModel, AChunkFarSlowerThanItsModelSaidShrinksTheNextOnesAtOnce) {
  model_settings s;
  producer_model m{true, s};
  answer(m, s, 1, 12, [](std::size_t n) { return 100.0 * static_cast<double>(n); });
  EXPECT_EQ(m.chunk_limit(s, 1), 20000u);
  // A slow patch: 20,000 items that took 100 times longer. The next chunk: one item grown once
  // (x16 while a chunk takes under a sixteenth of the target), growing again from there.
  m.learn(chunk_of_job(1, 20000), 20000 * 10'000, 0, true, s);
  EXPECT_LE(m.chunk_limit(s, 1), 16u);
}

TEST(ProducerModel, ADistantProducerThatStarvesGetsADeeperQueueAndLosesItSlowly) {
  model_settings s;
  s.chunk_size = 100;  // chunks of 100 items of 20 us: 2 ms each
  producer_model local{true, s}, far{false, s};
  for (auto* m : {&local, &far}) m->learn(chunk_of(100, 1), 100 * 20'000, 0, true, s);  // 2 ms
  EXPECT_EQ(far.depth, producer_model::min_depth);
  // It sat idle 5 ms with chunks on their way to it: 3 chunks more (ceil(5 / 2)).
  far.learn(chunk_of(100, 1), 100 * 20'000, 5'000'000, true, s);
  local.learn(chunk_of(100, 1), 100 * 20'000, 5'000'000, true, s);
  EXPECT_EQ(far.depth, producer_model::min_depth + 3);
  EXPECT_EQ(local.depth, producer_model::min_depth);  // local ones never deepen
  // A chunk sent to an empty queue says nothing about starving.
  far.learn(chunk_of(100, 0), 100 * 20'000, 50'000'000, true, s);
  EXPECT_EQ(far.depth, producer_model::min_depth + 3);
  // Calm answers: one chunk less after 8 x depth of them.
  for (std::size_t i = 0; i + 1 < 8 * 5; ++i) far.learn(chunk_of(100, 1), 100 * 20'000, 0, true, s);
  EXPECT_EQ(far.depth, 5u);
  far.learn(chunk_of(100, 1), 100 * 20'000, 0, true, s);
  EXPECT_EQ(far.depth, 4u);
  // Never deeper than max_depth, however long it starves.
  for (int i = 0; i < 10; ++i) far.learn(chunk_of(100, 1), 100 * 20'000, 1'000'000'000, true, s);
  EXPECT_EQ(far.depth, producer_model::max_depth);
  // Nor more work queued than max_depth chunks of 16 ms (512 ms): chunks of 64 ms (a node's, with
  // 128 producers on nodes), 8 of them; of 0.5 s, 2.
  far.learn(chunk_of(100, 1), 64'000'000, 1'000'000'000, true, s);
  EXPECT_EQ(far.depth, 8u);
  far.learn(chunk_of(100, 1), 500'000'000, 1'000'000'000, true, s);
  EXPECT_EQ(far.depth, producer_model::min_depth);
}

TEST(ProducerModel, HeavyTailedItemsDoNotPassForAFixedCostThatBalloonsTheChunks) {
  // Items of lognormal cost (median 50 us, sigma 1.5, capped at 50 ms; mean about 154 us), a
  // 2 ms target: a chunk's time varies far more with which items it holds than with how many.
  // A line through such answers showed a large fixed cost and a cost per item near 0, and the
  // chunks grew 16 times per answer (10, 160, 2,560 items: 0.38 s of work in
  // troupe_uneven_bench). A fixed cost lost in the scatter is none: the chunks are sized by the
  // items' mean cost and stay near the target's worth.
  model_settings s;
  producer_model m{true, s};
  std::mt19937_64 rng{7};
  std::lognormal_distribution<double> cost{std::log(50'000.0), 1.5};
  std::size_t biggest = 0, chunks = 0;
  for (std::size_t items = 0; items < 200'000; ++chunks) {
    auto n = m.chunk_limit(s, 1);
    biggest = std::max(biggest, n);
    double t = 0;
    for (std::size_t k = 0; k < n; ++k) t += std::min(50e6, cost(rng));
    items += n;
    m.learn(chunk_of_job(1, n), static_cast<std::int64_t>(t), 0, true, s);
  }
  // Sixteen targets' worth at the mean cost is about 208 items (a few answers' mean cost of
  // such items runs well below the mean: a run of cheap ones).
  EXPECT_LE(biggest, 256u) << "over " << chunks << " chunks";
  EXPECT_GE(chunks, 1'000u) << "the chunks hold about a target's worth (13 items)";
  // A batch producer's calls lie on their line: its fixed cost still shows through noise of a
  // tenth of a millisecond either way, and its batches still grow to full size.
  producer_model batch{true, s};
  std::uniform_real_distribution<double> noise{-100'000.0, 100'000.0};
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 40; ++i) {
    auto n = batch.chunk_limit(s, 1);
    sizes.push_back(n);
    auto t = 2'000'000.0 + 10'000.0 * static_cast<double>(n) + noise(rng);
    batch.learn(chunk_of_job(1, n), static_cast<std::int64_t>(t), 0, true, s);
  }
  // Full size from the fourth call on, and it stays there once the calls are all of that size
  // (the model forgot the fixed cost after about ten of them: 173 items).
  for (std::size_t i = 3; i < sizes.size(); ++i) EXPECT_GE(sizes[i], 1000u) << "call " << i;
  EXPECT_GE(batch.chunk_limit(s, 1), 1000u);
}

TEST(ProducerModel, BigChunksKeepTheQueueWithinItsByteBound) {
  model_settings s;
  s.max_chunk_bytes = 1 << 20;
  producer_model far{false, s};
  far.depth = 20;
  // Chunks of 4 MiB: 8 x 1 MiB allows 2 of them.
  far.learn(chunk_of(1, 1, 4 << 20), 1'000'000, 0, true, s);
  EXPECT_EQ(far.depth, producer_model::min_depth);
}

TEST(ProducerModel, RoomCountsChunksAndItemsInFlight) {
  model_settings s;
  producer_model m{true, s};
  EXPECT_TRUE(m.has_room(s));
  m.outstanding.push_back(chunk_of(1));
  m.outstanding.push_back(chunk_of(1));
  m.items = 2;
  EXPECT_FALSE(m.has_room(s));  // depth 2
  m.outstanding.pop_back();
  m.items = 1;
  EXPECT_TRUE(m.has_room(s));
  s.max_in_flight = 1;
  EXPECT_FALSE(m.has_room(s));  // one more item would pass max_in_flight
  m.state = troupe::detail::slot_state::lost;
  s.max_in_flight = 0;
  EXPECT_FALSE(m.has_room(s));
  EXPECT_EQ(m.load(), std::make_pair(0.5, std::size_t{1}));
}

TEST(ProducerModel, TheAutomaticReorderWindowCoversTheFastProducersWhileASlowOneWorks) {
  model_settings s;
  std::vector<producer_model> ps(2, producer_model{true, s});
  EXPECT_EQ(troupe::detail::reorder_window_chunks(ps, s), 8u);  // the floor: 4 per producer
  ps[0].ns_per_item = 1000;                                     // chunks of 1 item: 1 us
  ps[1].ns_per_item = 50'000;  // 50 us: 50 of the fast one's chunks
  // 2 x (2 x 50 + 2 x 1)
  EXPECT_EQ(troupe::detail::reorder_window_chunks(ps, s), 204u);
  ps[1].ns_per_item = 10'000'000;  // capped at 64 x, then at 256 chunks
  EXPECT_EQ(troupe::detail::reorder_window_chunks(ps, s), 256u);
  ps[1].state = troupe::detail::slot_state::lost;
  EXPECT_EQ(troupe::detail::reorder_window_chunks(ps, s), 8u);
  s.reorder_window = 3;
  EXPECT_EQ(troupe::detail::reorder_window_chunks(ps, s), 3u);
}

namespace {

std::int64_t thread_cpu_ns() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

bool pin_to_cpu0() {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(0, &one);
  return ::sched_setaffinity(0, sizeof one, &one) == 0;
}

/// A CPU-bound producer: it pins its thread to CPU 0 and computes for `ms` milliseconds of its
/// thread's CPU time, noting the call's wall and CPU time.
struct cpu_bound {
  struct producer {
    std::int64_t work(std::int64_t ms) {
      pinned = pin_to_cpu0();
      auto wall0 = std::chrono::steady_clock::now();
      auto cpu0 = thread_cpu_ns();
      while (thread_cpu_ns() - cpu0 < ms * 1'000'000) {
      }
      cpu_ns = thread_cpu_ns() - cpu0;
      wall_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::steady_clock::now() - wall0)
                    .count();
      return ms;
    }
    static inline std::atomic<bool> pinned{false};
    static inline std::atomic<std::int64_t> cpu_ns{0}, wall_ns{0};
  };
};

}  // namespace

TEST(Testing, ACpuProducersBusyTimeLeavesOutItsWaitsForACpu) {
  // Another thread spins on the producer's CPU, so its call of 20 ms of CPU time takes about
  // 40 ms of wall time. The call's busy time (what the chunk sizer learns from, and stats) is
  // what it cost: its CPU time, not the wait for a CPU that the machine's other threads cost it.
  std::atomic<bool> stop{false}, hog_pinned{false}, hog_running{false};
  std::thread hog{[&] {
    hog_pinned = pin_to_cpu0();
    hog_running = true;
    while (!stop.load(std::memory_order_relaxed)) {
    }
  }};
  while (!hog_running) std::this_thread::yield();
  troupe::testing::producer_probe<cpu_bound> probe;
  auto r = probe.send(troupe::work_chunk{1, 0, troupe::batch::of<std::int64_t>({20})});
  stop = true;
  hog.join();
  ASSERT_EQ(r.code, troupe::errc::none) << r.what;
  if (!hog_pinned || !cpu_bound::producer::pinned) GTEST_SKIP() << "no CPU affinity here";
  auto cpu = cpu_bound::producer::cpu_ns.load(), wall = cpu_bound::producer::wall_ns.load();
  if (troupe::detail::thread_run_delay_ns() == 0 && wall - cpu > cpu / 4)
    GTEST_SKIP() << "this kernel does not tell a thread's run delay (/proc/thread-self/schedstat)";
  ASSERT_GT(wall - cpu, cpu / 4) << "the two threads did not share the CPU: wall " << wall
                                 << " ns, CPU " << cpu << " ns";
  // Nearer its CPU time than its wall time (it waited about half the call for the CPU).
  EXPECT_LT(r.busy_ns, cpu + (wall - cpu) / 2) << "wall " << wall << " ns, CPU " << cpu << " ns";
  EXPECT_GE(r.busy_ns, cpu / 2) << "wall " << wall << " ns, CPU " << cpu << " ns";
}
