// A producer's cost model for one job (job_rate): a chunk of n items takes about a + b·n, fitted
// over its answers, and the chunk size it aims at; with the runner options it reads
// (model_settings). A part of the scheduler's core with no actor in it (no CAF header, no clock
// read), unit-tested in tests/producer_model_test.cpp; producer_model.hpp keeps one per job a
// producer works on.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace troupe::detail {

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
  // Weighted sums of the answers (n items, t ns): w, w·n, w·t, w·n², w·n·t, w·t², and the sum of
  // the squared weights (for the answers' effective number).
  double w = 0, wn = 0, wt = 0, wnn = 0, wnt = 0, wtt = 0, ww = 0;
  /// The fixed cost per call (ns) the answers show (0: none), decided at each answer (add): the
  /// line's, where it stands out of their scatter; kept while they are of one size, as a batch
  /// producer's are once its batches are full.
  double known_fixed = 0;

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

  /// Whether the line's fixed cost stands out of the answers' scatter (at least twice its
  /// standard error): a batch producer's calls lie on their line, and its fixed cost does. Items
  /// of heavy-tailed cost (a lognormal's) scatter a chunk's time far more than its size does: a
  /// line through them may show a large "fixed cost" and a cost per item near 0, and chunks sized
  /// from it grew 16 times per answer (10, 160, 2,560 items: 0.38 s of work for a 2 ms target).
  /// With the answers' effective number at 2 or less (two sizes, just seen), the line is taken.
  [[nodiscard]] bool fixed_cost_shown() const {
    auto [a, b] = fit();
    if (a <= 0) return false;
    auto m = ww > 0 ? w * w / ww : 0.0;  // effective number of answers (Kish)
    if (m <= 2) return true;
    auto mean_n = wn / w, mean_t = wt / w;
    auto var_n = wnn / w - mean_n * mean_n;
    if (var_n <= 0) return false;
    auto cov = wnt / w - mean_n * mean_t;
    auto residual = std::max(0.0, wtt / w - mean_t * mean_t - b * cov);  // per unit of weight
    auto se2 = residual * m / (m - 2) / m * (1 + mean_n * mean_n / var_n);
    return a * a >= 4 * se2;
  }

  /// The fixed cost per call (ns) and the cost per item (ns) now; (0, 0) before any answer.
  [[nodiscard]] std::pair<double, double> cost() const {
    if (w <= 0 || wn <= 0) return {0, 0};
    auto mean_n = wn / w, mean_t = wt / w;
    // The fixed cost the answers show (known_fixed) and the rest per item: along the line where
    // the sizes spread; where they are of one size lately (a batch producer at full batches),
    // their mean time less that fixed cost (forgotten, the batches fell to an eighth of their
    // size after about ten full ones). None shown (a negative one, or one lost in the scatter):
    // all of it per item, as a plain producer's. Bigger chunks no slower (b <= 0) with a fixed
    // cost shown: the calls' cost is fixed (a batch producer's), or a small chunk's thread was
    // woken late; the next, bigger answers tell which (new_job_limit bounds the job's tail).
    bool one_size_lately = !spread();
    if (known_fixed <= 0 || (one_size_lately && mean_t <= known_fixed))
      return {0, std::max(0.01, mean_t / mean_n)};
    return {known_fixed,
            std::max(0.01, one_size_lately ? (mean_t - known_fixed) / mean_n : fit().second)};
  }

  /// Whether a call's cost is mostly fixed (a batch producer's, a forward pass): answers of two
  /// sizes or more, the bigger ones slower, and a fixed cost of at least an eighth of `target`
  /// that outweighs the items' own cost in the calls answered.
  [[nodiscard]] bool mostly_fixed(double target) const {
    if (known_fixed <= 0) return false;
    auto [a, b] = spread() ? fit() : cost();
    if (spread() && b <= 0) return false;  // bigger chunks no slower: not told yet
    return a >= target / 8 && a >= b * wn / w;
  }

  /// Takes an answer: `n` items in `t` ns.
  void add(double n, double t) {
    constexpr double keep = 0.75;  // the weight an answer keeps at each later one
    w = keep * w + 1;
    wn = keep * wn + n;
    wt = keep * wt + t;
    wnn = keep * wnn + n * n;
    wnt = keep * wnt + n * t;
    wtt = keep * wtt + t * t;
    ww = keep * keep * ww + 1;
    answers += 1;
    if (spread()) {
      auto a = fit().first;
      known_fixed = a > 0 && fixed_cost_shown() ? a : 0;
    }
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
    // woken late, not the call's. But where the fixed cost alone is over 4 times the target (a
    // large model's forward pass of 200 ms, against 2 ms), each call outlasts that bound whatever
    // its size, and calls of one item each would pay it per item: twice the fixed cost then (it
    // is half the call), within a quarter of work_timeout when one is set.
    auto target = static_cast<double>(s.target_chunk_time.count());
    auto most = std::max(8 * target, 2 * a);
    if (s.work_timeout.count() > 0)
      most = std::min(most, std::max(8 * target, static_cast<double>(s.work_timeout.count()) / 4));
    target = std::max(target, std::min(10 * a, most));
    if (!local) target = std::max(target, remote_target(s));
    // At most 1e15 (units of a cost model may be tiny: items with troupe_cost).
    auto want = static_cast<std::size_t>(std::clamp((target - a) / b, 1.0, 1e15));
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

}  // namespace troupe::detail
