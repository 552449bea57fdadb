// What the scheduler knows of one producer: the chunks it holds, how long an item takes it
// (hence its chunk size) and how many chunks to keep queued at it (its depth). A part of the
// scheduler's core with no actor in it (no CAF header, no clock read: times come in as
// arguments), unit-tested on its own in tests/units_test.cpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

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

/// The runner options the model reads (from troupe::options).
struct model_settings {
  std::size_t chunk_size = 0;     ///< fixed chunk size (0: adaptive)
  std::size_t max_in_flight = 0;  ///< items outstanding per producer, at most (0: no limit)
  std::size_t max_chunk_items = 65536;
  std::chrono::nanoseconds target_chunk_time{std::chrono::milliseconds{2}};
  std::size_t max_chunk_bytes = std::size_t{64} << 20;
  std::size_t reorder_window = 0;  ///< fixed reorder window in chunks (0: automatic)
  /// Working producers on nodes, kept by the scheduler: a remote producer's chunks grow with
  /// them (job_rate::remote_target), since every remote chunk costs the one coordinator.
  std::size_t remote_producers = 0;
  /// options::work_timeout (0: none): a remote chunk that grows with the pool aims at a quarter
  /// of it at most, so that a healthy node is not given up on.
  std::chrono::nanoseconds work_timeout{0};
};

/// What a producer learned of one job's chunks: a chunk of n items takes about a + b·n (a: the
/// call's fixed cost, a kernel launch or a forward pass; b: the cost per item), fitted by least
/// squares over its answers, the older ones weighing less. A job's item cost does not carry to
/// another job: each job starts every producer on chunks of one item and grows them.
struct job_rate {
  /// A remote producer's chunks aim at this many times target_chunk_time, at least.
  static constexpr double remote_factor = 8;
  /// The coordinator's CPU per remote chunk (its message and answer through CAF, the decision),
  /// as measured with 128 node processes (BENCHMARKS.md: about 40 us), and the share of one
  /// core that the coordinator's remote chunks may take: P remote producers on chunks of time
  /// T cost it P / T * cost, so T >= P * cost / share.
  static constexpr double coordinator_ns_per_remote_chunk = 50'000;
  static constexpr double coordinator_share = 0.1;

  /// The time a remote producer's chunk aims at (ns): remote_factor times the target, or long
  /// enough that all remote producers' chunks together take at most coordinator_share of the
  /// coordinator's core (0.5 ms per remote producer: 16 ms up to 32 of them, 64 ms at 128, 0.5 s
  /// at 1,000), but that at most a quarter of work_timeout when it is set.
  [[nodiscard]] static double remote_target(const model_settings& s) {
    auto by_pool = static_cast<double>(s.remote_producers) * coordinator_ns_per_remote_chunk /
                   coordinator_share;
    if (s.work_timeout.count() > 0)
      by_pool = std::min(by_pool, static_cast<double>(s.work_timeout.count()) / 4);
    return std::max(remote_factor * static_cast<double>(s.target_chunk_time.count()), by_pool);
  }
  std::uint64_t job = 0;
  std::size_t chunk_items = 1;
  std::size_t answers = 0;
  // Weighted sums of the answers (n items, t ns): w, w·n, w·t, w·n², w·n·t.
  double w = 0, wn = 0, wt = 0, wnn = 0, wnt = 0;

  /// Whether its answers were all of one chunk size (or nearly): then fixed and per-item costs
  /// cannot be told apart yet.
  [[nodiscard]] bool one_size() const {
    if (w <= 0) return true;
    auto mean_n = wn / w;
    return wnn / w - mean_n * mean_n <= 1e-6 * mean_n * mean_n + 1e-12;
  }

  /// Whether the sizes answered spread enough for a line through them to mean anything: chunks
  /// of 6, 7 and 8 items whose times vary by a few milliseconds on a loaded machine fit a
  /// "fixed cost" and a cost per item near 0 (seen with 128 node processes: a node's chunks grew
  /// 7, 14, 28, 56, 896 items, 1.9 s of work in the job's tail). Sizes 1 and 2 spread enough.
  [[nodiscard]] bool spread() const {
    if (w <= 0) return false;
    auto mean_n = wn / w;
    return wnn / w - mean_n * mean_n >= 0.05 * mean_n * mean_n;
  }

  /// The least-squares line a + b·n through the answers, as fitted (either may be negative);
  /// answers of two sizes at least.
  [[nodiscard]] std::pair<double, double> fit() const {
    auto mean_n = wn / w, mean_t = wt / w;
    auto b = (wnt / w - mean_n * mean_t) / (wnn / w - mean_n * mean_n);
    return {mean_t - b * mean_n, b};
  }

  /// The fixed cost per call (ns) and the cost per item (ns) now; (0, 0) before any answer.
  [[nodiscard]] std::pair<double, double> cost() const {
    if (w <= 0 || wn <= 0) return {0, 0};
    auto mean_n = wn / w, mean_t = wt / w;
    // One chunk size seen so far (or sizes too close to tell a line): all of it per item, as a
    // plain producer.
    if (!spread()) return {0, std::max(0.01, mean_t / mean_n)};
    auto [a, b] = fit();
    // A negative fixed cost: none, all of it per item. Bigger chunks no slower (b <= 0): the
    // calls' cost is fixed (a batch producer's), or a small chunk's thread was woken late; the
    // next, bigger answers tell which (the job's tail is bounded by new_job_limit meanwhile).
    if (a < 0) return {0, std::max(0.01, mean_t / mean_n)};
    return {a, std::max(0.01, b)};
  }

  /// Whether a call's cost is mostly fixed (a batch producer's, a forward pass): answers of two
  /// sizes or more, the bigger ones slower, and a fixed cost of at least an eighth of `target`
  /// that outweighs the items' own cost in the calls answered.
  [[nodiscard]] bool mostly_fixed(double target) const {
    if (!spread()) return false;
    auto [a, b] = fit();
    return b > 0 && a >= target / 8 && a >= b * wn / w;
  }

  /// Takes an answer: `n` items in `t` ns.
  void add(double n, double t) {
    constexpr double keep = 0.75;  // the weight an answer keeps at each later one
    w = keep * w + 1;
    wn = keep * wn + n;
    wt = keep * wt + t;
    wnn = keep * wnn + n * n;
    wnt = keep * wnt + n * t;
    answers += 1;
  }

  /// Items per chunk for a chunk time of `target` ns: where the fixed cost is at most a tenth
  /// of the chunk (a batch producer's batches grow while that raises its items per second),
  /// else the target; at most 4 times the last size (slow start), and at once smaller when
  /// its items turned out slower.
  /// `local`: a producer in this process. A remote one's chunks aim at remote_target: each costs
  /// the coordinator tens of microseconds of CPU (the message, its answer), which must stay a
  /// small fraction of the chunk's work, and of the coordinator's core.
  void size(const model_settings& s, bool local = true) {
    auto [a, b] = cost();
    if (b <= 0) return;
    // At most 8 times the target: a fixed cost measured on a loaded machine may be a thread
    // woken late, not the call's.
    auto target = static_cast<double>(s.target_chunk_time.count());
    target = std::max(target, std::min(10 * a, 8 * target));
    if (!local) target = std::max(target, remote_target(s));
    auto want = static_cast<std::size_t>(std::max(1.0, (target - a) / b));
    // A local producer whose calls cost mostly the same whatever their size: no slow start. Each
    // smaller call pays the fixed cost again, and a chunk that turns out too big waits in the
    // producer's queue, where an idle producer takes part of it (split_late_chunks); the job's
    // share rule (scheduler::new_job_limit) bounds it meanwhile.
    if (local && mostly_fixed(static_cast<double>(s.target_chunk_time.count()))) {
      chunk_items = std::max<std::size_t>(1, std::min(want, s.max_chunk_items));
      return;
    }
    // One size seen: a call that took up to twice the target may be mostly fixed cost (a
    // batch producer's): try twice the items answered or planned already, whichever is more, so
    // that the next answers tell the two apart. Judged by the calls answered, not by the size
    // planned since: a call of 1 item that took the target kept the next at 1 item.
    if (one_size()) {
      auto seen = std::max(1.0, wn / w);
      if (b * seen <= 2 * target)
        want = std::max(want, 2 * std::max(chunk_items, static_cast<std::size_t>(seen)));
    }
    // Slow start: at most 4 times the last size per answer, or 16 times while a chunk takes
    // under a sixteenth of the target (trivial items reach full-size chunks in 4 answers, not
    // 8: each answer is a round trip while the producer waits).
    auto now_ns = a + b * static_cast<double>(chunk_items);
    double growth = now_ns * 16 < static_cast<double>(s.target_chunk_time.count()) ? 16 : 4;
    // Where a call's fixed cost dominates (a batch producer), more items barely lengthen it:
    // grow as far as doubles the call's time (at most 16x), not 4x.
    if (a > 0)
      growth = std::max(growth,
                        std::min(16.0, (2 * now_ns - a) / (b * static_cast<double>(chunk_items))));
    chunk_items = std::max<std::size_t>(
        1, std::min({want, s.max_chunk_items,
                     static_cast<std::size_t>(static_cast<double>(chunk_items) * growth)}));
  }
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
        it->size(s, local);
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
