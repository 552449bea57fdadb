// The scheduler's core on uneven work: item costs the user states (troupe_cost) and batch
// producers whose batches grow, in virtual time.
#include <cmath>
#include <functional>

#include "scheduler_core_parts.hpp"

namespace {

// -- item costs (troupe_cost) ------------------------------------------------------------------

/// An item whose cost the user states (troupe_cost, found by argument-dependent lookup).
struct weighted {
  std::int64_t cost = 1;
};
double troupe_cost(const weighted& w) {
  return static_cast<double>(w.cost);
}

TEST(SchedulerCore, ASourceOfItemsWithTroupeCostStopsAtTheItemThatCrossesTheCostBound) {
  // Costs count relative to the first item's (2 here): 2 + 2 + 2 crosses 2.4 times 2.
  std::vector<weighted> xs(10, weighted{2});
  xs[3].cost = 10;
  auto src = troupe::detail::make_job_source<weighted>(std::move(xs));
  ASSERT_TRUE(src->costed());
  src->limit_cost(2.4);
  auto b = src->pull(100, std::size_t{1} << 20, std::chrono::seconds{1});
  EXPECT_EQ(b.size(), 3u);
  EXPECT_EQ(src->last_cost(), 3.0);
  src->limit_cost(5);
  EXPECT_EQ(src->pull(100, std::size_t{1} << 20, std::chrono::seconds{1}).size(), 1u);  // 10
  EXPECT_EQ(src->last_cost(), 5.0);
  auto plain = troupe::detail::make_job_source<std::int64_t>(test_util::iota(10));
  EXPECT_FALSE(plain->costed());
}

/// Runs a job of `xs` on `f`'s one producer, item x taking ns_of(x) nanoseconds; returns each
/// chunk's time in nanoseconds and its items, in the order they were sent.
template <class W>
std::pair<std::vector<double>, std::vector<std::size_t>> run_timed(
    core_fixture& f, std::vector<W> xs, const std::function<double(const W&)>& ns_of) {
  auto job = std::make_shared<troupe::detail::job_core>(1, caf::actor{});
  f.core->start(job, troupe::detail::make_job_source<W>(std::move(xs)), false, {});
  std::vector<double> times;
  std::vector<std::size_t> sizes;
  for (int step = 0; step < 1000000 && !job->done(); ++step) {
    while (!f.io.to_consumer.empty()) {
      auto [msg, n] = std::move(f.io.to_consumer.front());
      f.io.to_consumer.pop_front();
      f.take(msg, n, *job->gate());
    }
    for (auto id : std::exchange(f.io.inputs_ended, {})) f.core->input_ended(id);
    if (f.io.chunks.empty()) continue;
    auto s = std::move(f.io.chunks.front());
    f.io.chunks.pop_front();
    auto& in = s.msg.items.template as<W>()->items;
    double time = 0;
    for (auto& w : in) time += ns_of(w);
    times.push_back(time);
    sizes.push_back(in.size());
    auto ns = static_cast<std::int64_t>(time);
    f.io.t += std::chrono::nanoseconds{ns};
    chunk_result r;
    r.run = s.msg.run;
    r.first = s.msg.first;
    r.busy_ns = ns;
    r.outputs = batch::of(in);
    f.core->on_result(s.p, s.gen, r.run, s.id, r);
  }
  EXPECT_TRUE(job->done());
  EXPECT_EQ(job->error(), nullptr);
  return {times, sizes};
}

/// The same for items taking their cost times `ns_per_cost`: each chunk's cost and items.
std::pair<std::vector<double>, std::vector<std::size_t>> run_weighted(core_fixture& f,
                                                                      std::vector<weighted> xs,
                                                                      double ns_per_cost) {
  auto [times, sizes] = run_timed<weighted>(f, std::move(xs), [ns_per_cost](const weighted& w) {
    return static_cast<double>(w.cost) * ns_per_cost;
  });
  for (auto& t : times) t /= ns_per_cost;
  return {times, sizes};
}

/// An item of a cost near the top of the double range, as a user may state one (bytes of a
/// file in a unit of their own, a product of dimensions).
struct vast {
  double cost = 1e308;
};
double troupe_cost(const vast& v) {
  return v.cost;
}

TEST(SchedulerCore, CostsNearTheTopOfTheDoubleRangeCountAsTheirRatiosDo) {
  // Two items of 1e308 added up to infinity: every chunk closed after its second item (50,001
  // chunks for 100,000 items of one cost, against 13 for cost 1).
  auto src = troupe::detail::make_job_source<vast>(std::vector<vast>(100, vast{}));
  src->limit_cost(40);
  EXPECT_EQ(src->pull(1000, std::size_t{1} << 20, std::chrono::seconds{1}).size(), 40u);
  EXPECT_EQ(src->last_cost(), 40.0);
  std::vector<vast> mixed{{1e300}, {1e308}, {1e300}, {std::numeric_limits<double>::infinity()}};
  auto m = troupe::detail::make_job_source<vast>(std::move(mixed));
  m->limit_cost(1e9);  // a ratio of 1e8 counts as it is; infinity stays infinite
  EXPECT_EQ(m->pull(10, std::size_t{1} << 20, std::chrono::seconds{1}).size(), 4u);
  EXPECT_TRUE(std::isinf(m->last_cost()));
  // The scheduler cuts a job of equal costs alike whatever their magnitude.
  troupe::options opts;
  opts.target_chunk_time = std::chrono::microseconds{200};
  opts.speculative = false;
  std::vector<std::size_t> chunks;
  for (double c : {1.0, 1e308}) {
    core_fixture f{{"cpu"}, opts};
    auto sizes = run_timed<vast>(f, std::vector<vast>(20000, vast{c}), [](const vast&) {
                   return 1000.0;
                 }).second;
    chunks.push_back(sizes.size());
  }
  std::cout << "chunks of 20,000 items of cost 1: " << chunks[0] << ", of cost 1e308: " << chunks[1]
            << "\n";
  EXPECT_LE(chunks[1], 2 * chunks[0] + 2) << "costs of 1e308 made short chunks";
}

TEST(SchedulerCore, TheFirstItemsStatedCostDoesNotSetTheChunksSize) {
  // 20,000 items of cost 1,000 (1 us each), the first one stated 1,000 times cheaper (an empty
  // sentence). The model counts units of the first chunk's mean cost, and max_chunk_items and
  // the job's share, which count items, were applied in those units: every chunk was 1,000
  // times too short (one item under a max_chunk_items of 1,000; a batch producer's batches stuck
  // at 50 where they reached 16,000).
  troupe::options opts;
  opts.target_chunk_time = std::chrono::microseconds{200};
  opts.speculative = false;
  opts.max_chunk_items = 1000;
  std::vector<std::size_t> chunks;
  for (std::int64_t first : {1000, 1}) {
    core_fixture f{{"cpu"}, opts};
    std::vector<weighted> xs(20000, weighted{1000});
    xs[0].cost = first;
    auto [costs, sizes] = run_weighted(f, std::move(xs), 1);
    chunks.push_back(sizes.size());
    std::cout << "first item of cost " << first << ": " << sizes.size() << " chunks, the largest "
              << *std::max_element(sizes.begin(), sizes.end()) << " items\n";
    EXPECT_GE(*std::max_element(sizes.begin(), sizes.end()), 100u);
  }
  EXPECT_LE(chunks[1], 2 * chunks[0]) << "the first item's cost shrank the chunks";
}

TEST(SchedulerCore, ItemsWithTroupeCostAreCutIntoChunksOfAboutEqualCost) {
  // Blocks of 500 light items (cost 1) and 500 heavy ones (cost 30), an item taking its cost in
  // microseconds. Chunks are cut by cost: where light items turn heavy, a chunk sized for light
  // items would cost 30 times its share (what happens without troupe_cost).
  troupe::options opts;
  opts.target_chunk_time = std::chrono::microseconds{200};
  opts.speculative = false;
  core_fixture f{{"cpu"}, opts};
  std::vector<weighted> xs;
  for (int block = 0; block < 8; ++block)
    for (int i = 0; i < 500; ++i) xs.push_back(weighted{block % 2 == 0 ? 1 : 30});
  auto [costs, sizes] = run_weighted(f, std::move(xs), 1000);
  ASSERT_GT(costs.size(), 30u);
  // After the first chunks (slow start), every chunk costs about the same (the last of each
  // may cross the bound by one item, and the job's last chunk is what is left)...
  std::vector<double> later(costs.begin() + 10, costs.end() - 1);
  auto sorted = later;
  std::sort(sorted.begin(), sorted.end());
  auto median = sorted[sorted.size() / 2];
  // (The cost model probes 2 and 4 times the size now and then while every answer is of one
  // size, to tell a fixed cost per call from the cost per item: those cost 2 to 4 times more.
  // Cut by count instead, the chunk where light items turn heavy costs 30 times more.)
  EXPECT_LE(sorted.back(), 5 * median) << "a chunk far over the cost of the others";
  // ... while the items per full-size chunk follow the items' weight.
  std::size_t most = 0, least = std::numeric_limits<std::size_t>::max();
  for (std::size_t i = 10; i + 1 < costs.size(); ++i)
    if (costs[i] >= median / 2) {
      most = std::max(most, sizes[i]);
      least = std::min(least, sizes[i]);
    }
  EXPECT_GE(most, 10 * least) << "chunks of light and heavy items held as many items";
}

/// Two local batch producers whose calls cost 2 ms + 10 us per item, in virtual time: each works
/// its chunks in the order sent, and the scheduler hears of each when it is done. Returns the
/// makespan and each producer's call sizes, in order.
struct batch_run {
  clock_type::duration makespan{};
  std::vector<std::vector<std::size_t>> calls;
};
batch_run run_batch_producers(std::size_t chunk_size, std::int64_t items) {
  troupe::options opts;
  opts.chunk_size = chunk_size;
  opts.speculative = false;
  opts.split_late_chunks = false;  // (a split chunk's items would need claiming here)
  core_fixture f{{"cpu", "cpu"}, opts};
  auto job = f.submit(1, items, false);
  auto start = f.io.t;
  batch_run out;
  out.calls.resize(2);
  std::vector<std::deque<fake_io::sent>> queue(2);
  std::vector<clock_type::time_point> free_at(2, start), done_at(2, start);
  for (int step = 0; step < 100000 && !job->done(); ++step) {
    f.consume_all();
    for (auto id : std::exchange(f.io.inputs_ended, {})) f.core->input_ended(id);
    while (!f.io.chunks.empty()) {
      auto s = std::move(f.io.chunks.front());
      f.io.chunks.pop_front();
      if (queue[s.p].empty())
        done_at[s.p] = std::max(free_at[s.p], f.io.t) + 2ms + 10us * s.msg.items.size();
      queue[s.p].push_back(std::move(s));
    }
    // The producer whose current call ends first answers it.
    std::optional<std::size_t> next;
    for (std::size_t p = 0; p < 2; ++p)
      if (!queue[p].empty() && (!next || done_at[p] < done_at[*next])) next = p;
    if (!next) continue;
    auto p = *next;
    auto s = std::move(queue[p].front());
    queue[p].pop_front();
    auto n = s.msg.items.size();
    auto busy = 2ms + 10us * n;
    f.io.t = done_at[p];
    free_at[p] = done_at[p];
    out.calls[p].push_back(n);
    auto r = echo(s, std::chrono::duration_cast<std::chrono::nanoseconds>(busy).count());
    f.core->on_result(s.p, s.gen, s.msg.run, s.id, r);
    if (!queue[p].empty()) done_at[p] = free_at[p] + 2ms + 10us * queue[p].front().msg.items.size();
  }
  EXPECT_TRUE(job->done());
  EXPECT_EQ(job->error(), nullptr);
  out.makespan = f.io.t - start;
  return out;
}

TEST(SchedulerCore, ABatchProducersBatchesGrowWithinAFewCallsAndTheProducersEndTogether) {
  // A batch producer whose call costs 2 ms whatever its size, plus 10 us per item (a forward
  // pass), in a plain run of 5,000 items on two producers: a job not seen yet starts on one
  // item, the chunk queued behind it holds two (so that the first answers differ in size and
  // tell the fixed cost from the cost per item), and once they do the batches go straight to
  // the target's size; the producers' last chunks end together instead of shrinking into more
  // calls that each pay the 2 ms again. Before: 1 1 2 2 32 512 1020 765 574 430... per producer.
  // Against the best of a sweep of fixed sizes, in the same virtual time: at least 0.9 of its
  // items per second.
  auto best = clock_type::duration::max();
  for (std::size_t size : {64, 128, 256, 512, 1024, 2048, 4096})
    best = std::min(best, run_batch_producers(size, 5'000).makespan);
  // A pull from the source stops after target_chunk_time of real time (a slow source must not
  // hold a chunk back), and a test thread preempted in a pull looks like a slow source: its
  // chunk is cut short and one more call pays the 2 ms. Up to 3 runs, one of which must meet
  // the ratio; the call sizes are checked in every run.
  double ratio = 0;
  std::ostringstream seen;
  for (int attempt = 0; attempt < 3 && ratio < 0.9; ++attempt) {
    auto adaptive = run_batch_producers(0, 5'000);
    std::size_t calls = 0;
    for (auto& c : adaptive.calls) {
      ASSERT_GE(c.size(), 2u);
      EXPECT_EQ(c[0], 1u) << "a new job's first chunk holds one item";
      EXPECT_LE(c[1], 2u);
      calls += c.size();
    }
    seen.str("");
    for (auto& c : adaptive.calls) {
      seen << "\n ";
      for (auto n : c) seen << " " << n;
    }
    EXPECT_LE(calls, 12u) << "calls by producer:" << seen.str();
    ratio = std::chrono::duration<double>(best).count() /
            std::chrono::duration<double>(adaptive.makespan).count();
    seen << "\n adaptive " << std::chrono::duration<double>(adaptive.makespan).count() << " s";
  }
  EXPECT_GE(ratio, 0.9) << "best fixed " << std::chrono::duration<double>(best).count()
                        << " s; calls by producer:" << seen.str();
}

TEST(SchedulerCore, ABatchProducersLastBatchTakesWhatWouldBeLeftOfItsShare) {
  // 3,000 items on two batch producers (2 ms per call + 10 us per item): once the first answers
  // show the fixed cost, the model's size is 1,400 items (a fixed cost of a tenth of the call,
  // within 8 times the target) and each producer's share of what is left about 1,500. A chunk
  // of the model's size would leave about 100 items for a fifth call that pays the 2 ms again
  // (before: 1 2 4 1400 186 on one producer, 1 2 4 1400 on the other): what is left of the
  // share goes with it.
  auto run = run_batch_producers(0, 3'000);
  std::ostringstream seen;
  for (auto& c : run.calls) {
    seen << "\n ";
    for (auto n : c) seen << " " << n;
  }
  for (auto& c : run.calls) {
    ASSERT_GE(c.size(), 4u) << "calls by producer:" << seen.str();
    EXPECT_EQ(c.size(), 4u) << "calls by producer:" << seen.str();
    EXPECT_GT(c.back(), 1'400u) << "calls by producer:" << seen.str();
  }
}

TEST(SchedulerCore, ANewJobsSecondChunkHoldsEightItemsWhereChunksCanBeCut) {
  // Its first answers must differ in size by more than a first call's own overhead: a batch
  // producer's calls of 1 and 4 items (2 ms + 10 us per item) differ by 30 us, about what a
  // job's first call costs more than the next, and its batches then grew 16x once more before
  // the full size. Where chunks cannot be cut, two: an idle producer could not take the items
  // of a chunk that turns out slow.
  for (bool cuts : {true, false}) {
    troupe::options opts;
    opts.split_late_chunks = cuts;
    core_fixture f{{"cpu", "cpu"}, opts};
    f.submit(1, 1'000, false);
    std::map<std::size_t, std::vector<std::size_t>> sizes;  // by producer, in the order sent
    for (auto& c : f.io.chunks) sizes[c.p].push_back(c.msg.items.size());
    ASSERT_EQ(sizes.size(), 2u);
    for (auto& [p, n] : sizes)
      EXPECT_EQ(n, (std::vector<std::size_t>{1, cuts ? 8u : 2u})) << "producer " << p;
  }
}

}  // namespace
