// What the scheduler knows of one producer: the chunks it holds, how long an item takes it
// (hence its chunk size; per job: cost_model.hpp) and how many chunks to keep queued at it (its
// depth). A part of the scheduler's core with no actor in it (no CAF header, no clock read: times
// come in as arguments), unit-tested on its own in tests/producer_model_test.cpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "cost_model.hpp"
#include "slot_state.hpp"
#include "troupe/detail/chunk_cut.hpp"

namespace troupe::detail {

using clock_type = std::chrono::steady_clock;

/// A chunk sent to a producer and not answered yet.
struct sent_chunk {
  std::uint64_t job = 0;
  std::uint64_t id = 0;  ///< the piece's id in its job's table
  std::size_t items = 0;
  /// Its size for the cost model: its items, or, for items with troupe_cost, its cost in
  /// multiples of the job's mean cost per item (0: its items).
  double units = 0;
  [[nodiscard]] double size() const noexcept {
    return units > 0 ? units : static_cast<double>(items);
  }
  clock_type::time_point sent;
  std::size_t behind = 0;  ///< chunks the producer still had when this one was sent
  std::size_t bytes = 0;   ///< the chunk's size in memory (max_chunk_bytes when unknown)
  /// options::split_late_chunks: where it ends, shared with its producer (null: not cut).
  std::shared_ptr<chunk_cut> cut;
  /// A node's producer: the chunk's number for a trim (0: not cut), and whether a trim is on its
  /// way (its answer, or the chunk's, says where it ended).
  std::uint64_t cut_id = 0;
  bool trimming = false;
  /// A node's chunk: when a trim last took items, and when the next may be sent (a trim that
  /// took nothing waits a target chunk time). `asked` holds the first trim that took nothing
  /// since items were last taken: a speculative copy waits 10 target chunk times from either.
  std::optional<clock_type::time_point> taken, trim_again;
  /// When its producer was first asked for the items it claimed and has not started.
  std::optional<clock_type::time_point> asked;
  std::uint64_t asked_started = 0;  ///< the items it had started then (chunk_cut::started)
  /// When the scheduler last looked at its cut, and the items claimed then (its pace).
  std::optional<clock_type::time_point> looked;
  std::uint64_t looked_next = 0;
};

class producer_model {
 public:
  static constexpr std::size_t min_depth = 2;   ///< chunks queued at a producer, at least
  static constexpr std::size_t max_depth = 32;  ///< and at most (distant producers),
  /// holding at most this many times max_chunk_bytes
  static constexpr std::size_t max_queued_chunk_bytes = 8;

  producer_model() = default;
  producer_model(bool local, const model_settings& s) : local(local) {
    if (s.chunk_size) chunk_items = s.chunk_size;
  }

  bool local = true;  ///< in this process: answers within microseconds
  /// Where it is in its life; changed only through next() (scheduler::move).
  slot_state state = slot_state::working;
  std::vector<sent_chunk> outstanding;  ///< in the order sent (a producer works FIFO)
  /// Chunk `id` of `job` in outstanding, or outstanding.end().
  std::vector<sent_chunk>::iterator find(std::uint64_t job, std::uint64_t id) {
    return std::find_if(outstanding.begin(), outstanding.end(),
                        [&](const sent_chunk& c) { return c.job == job && c.id == id; });
  }
  std::size_t items = 0;   ///< items outstanding
  double ns_per_item = 0;  ///< measured inside producer::work; 0 = not yet
  std::size_t chunk_items = 1;
  std::size_t depth = min_depth;  ///< chunks kept queued at it
  std::size_t calm = 0;           ///< answers in a row without the producer starving
  double chunk_bytes = 0;         ///< the size of the chunks it gets, on average
  /// The jobs it worked on lately (most recent last), each with its own cost model.
  std::vector<job_rate> rates;
  static constexpr std::size_t max_rates = 16;

  /// What it learned of `job`'s chunks, or null (none answered yet).
  [[nodiscard]] const job_rate* rate(std::uint64_t job) const {
    for (auto& r : rates)
      if (r.job == job) return &r;
    return nullptr;
  }

  /// Items in `job`'s next chunk, at most: one at first (a job not seen yet is not sized from
  /// another job's items here; scheduler::new_job_limit does so when more jobs are open than
  /// producers), then by the job's own cost model.
  [[nodiscard]] std::size_t chunk_limit(const model_settings& s, std::uint64_t job) const {
    if (s.chunk_size) return chunk_limit(s);
    auto* r = rate(job);
    auto n = r ? r->chunk_items : std::size_t{1};
    if (s.max_in_flight) n = std::min(n, s.max_in_flight);
    return std::max<std::size_t>(n, 1);
  }

  /// The time of one of `job`'s items here (ns): its own model's, else the producer's.
  [[nodiscard]] double ns_per_item_of(std::uint64_t job) const {
    if (auto* r = rate(job); r && r->answers > 0) {
      auto [a, b] = r->cost();
      (void)a;
      return b;
    }
    return ns_per_item;
  }

  /// The time `job`'s chunk of `items` should take here (ns): a + b·items.
  [[nodiscard]] double chunk_ns_of(std::uint64_t job, double items) const {
    if (auto* r = rate(job); r && r->answers > 0) {
      auto [a, b] = r->cost();
      return a + b * items;
    }
    return ns_per_item * items;
  }

  /// Forgets `job` (it ended).
  /// The slot never takes work again (a remote producer lost, a retired one): its model's memory
  /// goes (a job_rate per job it worked lately, a few kB), its numbers stay in stats(). Slots
  /// are never reused, so a long-lived runner whose nodes come and go would keep them all.
  void release() {
    std::vector<sent_chunk>().swap(outstanding);
    std::vector<job_rate>().swap(rates);
  }

  void forget(std::uint64_t job) {
    rates.erase(std::remove_if(rates.begin(), rates.end(),
                               [job](const job_rate& r) { return r.job == job; }),
                rates.end());
  }

  /// Items in its next chunk, at most.
  [[nodiscard]] std::size_t chunk_limit(const model_settings& s) const {
    auto n = s.chunk_size ? s.chunk_size : chunk_items;
    if (s.max_in_flight) n = std::min(n, s.max_in_flight);
    return std::max<std::size_t>(n, 1);
  }

  /// Whether it may take another chunk now.
  [[nodiscard]] bool has_room(const model_settings& s) const {
    if (!alive(state) || leaving(state) || outstanding.size() >= depth) return false;
    return !(s.max_in_flight && !outstanding.empty() && items + chunk_limit(s) > s.max_in_flight);
  }

  /// How loaded it is (for choosing the least loaded first): queue fill, then items.
  [[nodiscard]] std::pair<double, std::size_t> load() const {
    return {static_cast<double>(outstanding.size()) / static_cast<double>(depth), items};
  }

  /// Learns from the answer to `rec`: the time per item (hence the chunk size) and, for a
  /// distant producer, how many chunks to keep queued. `busy_ns`: time inside producer::work;
  /// `idle_ns`: time it sat idle before this chunk; `ok`: the chunk worked.
  void learn(const sent_chunk& rec, std::int64_t busy_ns, std::int64_t idle_ns, bool ok,
             const model_settings& s) {
    auto busy = static_cast<double>(busy_ns);
    if (rec.items > 0 && ok) {
      auto it = std::find_if(rates.begin(), rates.end(),
                             [&](const job_rate& r) { return r.job == rec.job; });
      if (it == rates.end()) {
        if (rates.size() >= max_rates) rates.erase(rates.begin());
        rates.push_back(job_rate{});
        rates.back().job = rec.job;
        // Its size plan starts from the biggest chunk of the job sent here (a second one is
        // queued behind the first at twice its size: scheduler::new_job_limit).
        for (auto& c : outstanding)
          if (c.job == rec.job)
            rates.back().chunk_items = std::max(rates.back().chunk_items, c.items);
        it = rates.end() - 1;
      }
      auto before = it->answers > 0 ? it->cost() : std::pair<double, double>{0, 0};
      auto n = rec.size();
      auto predicted = before.first + before.second * n;
      bool restart = it->answers > 0 && busy > 4 * predicted;
      if (restart) {
        // Far slower than its model said (a slow patch of items): start the model again from
        // this answer, so that the next chunks shrink at once.
        auto job = it->job;
        auto items = it->chunk_items;
        *it = job_rate{};
        it->job = job;
        it->chunk_items = items;
      }
      it->add(n, std::max(busy, 1.0));
      if (!s.chunk_size) {
        if (restart) it->chunk_items = 1;  // grows again from one item: ×4 per answer
        // Items with troupe_cost: the model counts units, and max_chunk_items, which counts
        // items, bounds the chunk as it is pulled (scheduler::dispatch_from) instead.
        auto by_units = s;
        if (rec.units > 0) by_units.max_chunk_items = std::numeric_limits<std::size_t>::max();
        it->size(by_units, local);
      }
      // Trivial items take well under 1 ns each (x*x over numbers in the cache).
      auto per_item = std::max(0.01, busy / n);
      ns_per_item = ns_per_item == 0 ? per_item : 0.5 * ns_per_item + 0.5 * per_item;
      if (!s.chunk_size) {
        auto target = static_cast<double>(s.target_chunk_time.count());
        auto want = static_cast<std::size_t>(std::max(1.0, target / ns_per_item));
        chunk_items =
            std::max<std::size_t>(1, std::min({want, s.max_chunk_items, chunk_items * 4}));
      }
    }
    // A local producer answers within microseconds: two chunks keep it busy. (Its answers can
    // still wait while the scheduler pulls input; queuing more for that would only cost memory.)
    if (local || !ok) return;
    // A distant producer that sat idle although chunks were queued for it (this one was sent
    // behind others) starved while they travelled: keep that much more work queued. Shrink
    // slowly while it never starves, within [min_depth, max_depth] (the memory bound).
    chunk_bytes = chunk_bytes == 0 ? static_cast<double>(rec.bytes)
                                   : 0.8 * chunk_bytes + 0.2 * static_cast<double>(rec.bytes);
    // Never more than max_queued_chunk_bytes queued, beyond two chunks: big items (tensors) need
    // no deep queue to fill a link, and must not pile up in memory.
    auto by_bytes = std::max<std::size_t>(
        min_depth,
        static_cast<std::size_t>(static_cast<double>(max_queued_chunk_bytes * s.max_chunk_bytes) /
                                 std::max(1.0, chunk_bytes)));
    // What a chunk takes there now: this one's time (a node's chunks grow with the pool, see
    // job_rate::remote_target), else the producer's estimate.
    auto chunk_ns = std::max(
        1.0, rec.items > 0 && busy > 0 ? busy : ns_per_item * static_cast<double>(chunk_limit(s)));
    // Never more work queued than max_depth chunks of remote_factor times the target (512 ms by
    // default), beyond two chunks: longer chunks, fewer of them (a drain, a job arriving behind
    // them and the job's tail wait for what is queued).
    auto by_time = std::max<std::size_t>(
        min_depth,
        static_cast<std::size_t>(static_cast<double>(max_depth) * job_rate::remote_factor *
                                 static_cast<double>(s.target_chunk_time.count()) / chunk_ns));
    depth = std::min({depth, by_bytes, by_time});
    if (rec.behind == 0) return;
    auto idle = static_cast<double>(idle_ns);
    if (idle > 0.1 * chunk_ns) {
      depth = std::min({max_depth, by_bytes, by_time,
                        depth + static_cast<std::size_t>(std::ceil(idle / chunk_ns))});
      calm = 0;
    } else if (++calm >= 8 * depth && depth > min_depth) {
      depth -= 1;
      calm = 0;
    }
  }
};

/// The reorder window of an ordered job, in chunks. Fixed (settings), or automatic: room for
/// every live producer's queue twice over, counted in the chunks of the fastest one, so that
/// while a slow producer works through its queue the fast ones do not run out of window; at
/// least 4 per producer, at most 256 (or that floor), for the memory bound.
template <class Model>
std::size_t reorder_window_chunks(const std::vector<Model>& producers, const model_settings& s) {
  if (s.reorder_window) return s.reorder_window;
  double slowest = 0;
  for (const producer_model& p : producers)
    if (alive(p.state))
      slowest = std::max(slowest, p.ns_per_item * static_cast<double>(p.chunk_limit(s)));
  std::size_t chunks = 0;
  for (const producer_model& p : producers) {
    if (!alive(p.state)) continue;
    auto own = std::max(1.0, p.ns_per_item * static_cast<double>(p.chunk_limit(s)));
    auto ratio = p.ns_per_item > 0 ? std::min(64.0, std::ceil(slowest / own)) : 1.0;
    chunks += p.depth * static_cast<std::size_t>(ratio);
  }
  std::size_t present = 0;  // slots of removed producers are kept, but not counted
  for (const producer_model& p : producers) present += p.state == slot_state::retired ? 0 : 1;
  auto floor = 4 * std::max<std::size_t>(1, present);
  return std::clamp(2 * chunks, floor, std::max<std::size_t>(floor, 256));
}

}  // namespace troupe::detail
