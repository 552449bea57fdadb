// The scheduler (scheduler.hpp): how many items a job's next chunk to a producer holds, from
// the producer's cost model for that job (producer_model.hpp), the job's size and what is left
// of it (docs/api.md, "The chunk sizer's cost model").
#include <algorithm>
#include <cmath>

#include "scheduler.hpp"

namespace troupe::detail {

std::size_t scheduler::new_job_limit(const job_state& j, const producer_slot& s) const {
  // A job not seen yet starts on one-item chunks, so that idle producers share its first items
  // whatever they cost. With more jobs open than producers (many small jobs from many callers)
  // no producer is idle for long: splitting a 3-item job into three chunks would only triple
  // the messages, so such a job starts at the producer's estimate from the other jobs.
  if (!s.rate(j.id) && jobs_.size() > producers_.size()) return chunk_limit(s);
  auto n = chunk_limit(s, j.id);
  auto* r = s.rate(j.id);
  // Not answered here yet: the chunk queued behind its first one-item chunk holds eight items
  // (two where it cannot be cut), so that its first two answers differ in size and tell a call's
  // fixed cost from its cost per item (a batch producer's batches then grow an answer sooner).
  // Eight: a batch producer's calls of 1 and 4 items (2 ms + 10 us per item) differ by 30 us,
  // about what a job's first call costs more than the next (20 to 50 us), so that bigger calls
  // could look no slower and the batches grow 16x once more before the full size.
  // Where chunks can be cut (split_late_chunks), an idle producer takes its items if the first
  // turns out slow. Not under a work_timeout: a chunk of several slow items (each well within
  // it) would outlast it and its healthy producer would be given up on.
  if (r == nullptr && !settings_.chunk_size && opts_.work_timeout.count() == 0 &&
      std::any_of(s.outstanding.begin(), s.outstanding.end(),
                  [&](const sent_chunk& c) { return c.job == j.id; })) {
    n = s.cuts ? 8 : 2;
    if (settings_.max_in_flight) n = std::min(n, settings_.max_in_flight);
  }
  // A job of known size: the chunks queued at a producer hold at most its share of the items
  // left, so that the last chunks are small and the producers finish together (a queue of big
  // chunks at a slow producer would be the job's tail); but never below an eighth of the target's
  // worth of items, nor below twice the fixed cost per call (smaller chunks would cost more in
  // messages and calls than the balance gains).
  if (auto total = j.source->total(); total && r != nullptr && !settings_.chunk_size) {
    // Counted in the model's units (items, or for items with troupe_cost, multiples of the first
    // chunk's mean cost per item): the items left and the even split through the job's mean.
    auto upi = j.units_per_item();
    auto in_units = [upi](std::uint64_t items) {
      return static_cast<std::uint64_t>(
          std::min(1e15, std::ceil(static_cast<double>(items) * upi)));
    };
    auto left = in_units(*total > j.next_item ? *total - j.next_item : 0);
    auto [a, b] = r->cost();
    auto target = static_cast<double>(settings_.target_chunk_time.count());
    auto floor_ns = std::max(target / 8, 2 * a);
    auto floor = static_cast<std::uint64_t>(std::max(1.0, std::ceil(floor_ns / std::max(b, 0.01))));
    // Never more than an even split of the job, though: a cost per item not measured yet
    // (bigger chunks were no slower: b at its least) would make the floor the whole job.
    auto ways = std::max<std::uint64_t>(1, producers_.size());
    floor = std::min(floor, std::max<std::uint64_t>(1, in_units((*total + ways - 1) / ways)));
    std::uint64_t share = 0;
    if (s.local && r->mostly_fixed(target)) {
      // A call's fixed cost is a large part of it (a batch producer's): every smaller chunk pays
      // it again, so the producers end together instead, each taking at once what is left of its
      // share of the items not answered yet (those queued here counted).
      auto answered = std::min<std::uint64_t>(j.sent_to_consumer, j.next_item);
      auto undone = left + in_units(j.next_item - answered);
      std::uint64_t mine = 0;
      for (auto& c : s.outstanding)
        if (c.job == j.id) mine += static_cast<std::uint64_t>(std::min(1e15, std::ceil(c.size())));
      auto fair = (undone + ways - 1) / ways;
      share = fair > mine ? fair - mine : 0;
      // What would be left of that share after a chunk of the model's size, if at most half of
      // it, goes with it: another call would pay the fixed cost again for a short batch.
      if (share > n && share - n <= n / 2)
        n = static_cast<std::size_t>(std::min<std::uint64_t>(share, settings_.max_chunk_items));
    } else {
      // Counted in the chunks queued at this producer: a distant one keeps up to 32 of them.
      auto slots = ways * std::max<std::uint64_t>(2, s.depth);
      share = (left + slots - 1) / slots;
    }
    n = std::min<std::size_t>(n, static_cast<std::size_t>(std::max<std::uint64_t>(share, floor)));
    // What would be left after it is less than half a chunk worth its call: take it now.
    if (left > n && left - n < (floor + 1) / 2 && left <= chunk_limit(s, j.id))
      n = static_cast<std::size_t>(left);
  }
  return n;
}

std::size_t scheduler::folded_chunk_limit(const job_state& j, const producer_slot& s) const {
  auto base = chunk_limit(s, j.id);
  auto per_item = s.rate(j.id) ? s.ns_per_item_of(j.id) : 0.0;  // never another job's items
  if (settings_.chunk_size || settings_.max_in_flight || per_item <= 0) return base;
  auto items_in = [&](double ns) { return static_cast<std::size_t>(std::max(1.0, ns / per_item)); };
  auto target = static_cast<double>(settings_.target_chunk_time.count());
  auto want = items_in(target);
  if (auto total = j.source->total()) {
    std::uint64_t staying = 0;  // alive and not leaving
    for (auto& q : producers_) staying += alive(q.state) && !leaving(q.state) ? 1 : 0;
    auto left = *total > j.next_item ? *total - j.next_item : 0;
    auto share = (left + 2 * staying - 1) / std::max<std::uint64_t>(1, 2 * staying);
    want = static_cast<std::size_t>(std::min<std::uint64_t>(want, share));
  }
  // Not below a 40th of the target (50 us by default): smaller chunks cost more in messages
  // than they gain in balance.
  return std::max(want, std::min(base, items_in(target / 40)));
}

}  // namespace troupe::detail
