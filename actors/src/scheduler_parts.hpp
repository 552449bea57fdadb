// The scheduler's bookkeeping, as small classes with their own unit tests
// (tests/scheduler_parts_test.cpp): the reorder window of an ordered job, and the table of a job's
// pieces in flight (which producers hold each one, which wait to be sent again). Templates over the
// payload (troupe::batch in the scheduler, anything with empty() in a test), so that no CAF
// header is included here (tests/CMakeLists.txt checks that).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace troupe {
class batch;
}

namespace troupe::detail {

using clock_type = std::chrono::steady_clock;

/// Asks the cache for the lines of [p, p + n) (an object about to be read that is likely cold:
/// issued together, the misses overlap instead of coming one after the other).
inline void prefetch_bytes(const void* p, std::size_t n) noexcept {
  auto* c = static_cast<const char*>(p);
  for (std::size_t b = 0; b < n; b += 64) __builtin_prefetch(c + b);
  if (n > 0) __builtin_prefetch(c + n - 1);
}

/// The outputs of an ordered job that wait for the ones ahead of them. Each entry covers the
/// items [first, first + count) of the job's input; an entry without outputs stands for
/// skipped items. Entries are released strictly in input order, each exactly once.
template <class Batch>
class basic_reorder_window {
 public:
  /// Throws std::logic_error for a range already released or already held.
  void add(std::uint64_t first, std::uint64_t count, Batch outputs) {
    if (count == 0) return;
    if (first < next_) throw std::logic_error("reorder_window: a range released before");
    auto [i, fresh] = pending_.emplace(first, entry{count, std::move(outputs)});
    if (!fresh) throw std::logic_error("reorder_window: a range added twice");
    (void)i;
  }
  /// Hands each entry that is next in order to `f(batch)` (skipped ranges are passed over),
  /// in order. Returns the number of entries released.
  template <class F>
  std::size_t release(F&& f) {
    std::size_t n = 0;
    for (auto i = pending_.begin(); i != pending_.end() && i->first == next_;
         i = pending_.erase(i)) {
      next_ += i->second.count;
      ++n;
      if (!i->second.outputs.empty()) f(std::move(i->second.outputs));
    }
    return n;
  }
  /// The index of the next item to release.
  [[nodiscard]] std::uint64_t next() const noexcept { return next_; }
  [[nodiscard]] std::size_t size() const noexcept { return pending_.size(); }
  [[nodiscard]] bool empty() const noexcept { return pending_.empty(); }

 private:
  struct entry {
    std::uint64_t count;
    Batch outputs;
  };
  std::map<std::uint64_t, entry> pending_;
  std::uint64_t next_ = 0;
};

/// Items of a job on their way: sent to one or more producers (a speculative copy), or queued
/// to be sent (again: after a producer was lost, or to retry an item that threw).
template <class Batch>
struct basic_piece {
  std::uint64_t first = 0;  ///< index of its first item in the job's input
  Batch items;
  std::vector<std::size_t> holders;  ///< producers it was sent to that may still answer
  unsigned attempt = 0;              ///< attempts of its items that threw already
  /// Items with troupe_cost: its cost in multiples of the job's mean cost per item (0: count).
  double units = 0;
  std::optional<std::size_t> avoid;  ///< the producer its item threw on (a retry)
  clock_type::time_point not_before{};
  std::string last_error;  ///< what its item threw last (a retry)
  std::string last_where;
  /// A trim of it is on its way to its node: no speculative copy until it is answered (the copy
  /// would hold items the trim moves).
  bool trimming = false;
};

/// A job's pieces by id. Ids are handed out in order and mostly answered in order, so the live
/// ones sit in a window [base_, next_id_), kept in a ring of pieces whose slot for an id is
/// id & (size - 1): finding one is a load from an address known without a load (BENCHMARKS.md,
/// "the scheduler alone": a hash table's bucket, node and chain were three dependent cache misses
/// per answer at 8,000 producers). A piece left far behind the window (a chunk stuck while
/// thousands pass) moves to a map of its own, so that the ring stays within a few times the
/// pieces alive. A pointer from find() is valid until the next add() (which may move pieces)
/// or until its piece is taken out.
template <class Batch>
class basic_inflight_table {
 public:
  using piece = basic_piece<Batch>;

  /// Adds a piece about to be sent; returns its id.
  std::uint64_t add(piece p) {
    auto id = next_id_++;
    if (in_ring_ == 0) base_ = id;
    if (id - base_ >= ring_.size()) make_room(id);
    ring_[id & (ring_.size() - 1)].emplace(std::move(p));
    ++in_ring_;
    return id;
  }
  /// Adds a piece to be sent when a producer has room (not before p.not_before).
  std::uint64_t add_queued(piece p) {
    auto first = p.first;
    auto id = add(std::move(p));
    queue_.emplace(first, id);
    return id;
  }
  /// Asks the cache for id's piece ahead of find() (an answer's first misses are independent:
  /// its producer's slot and this).
  void prefetch(std::uint64_t id) const noexcept {
    if (in_window(id)) prefetch_bytes(&ring_[id & (ring_.size() - 1)], sizeof(ring_[0]));
  }
  piece* find(std::uint64_t id) {
    if (in_window(id)) {
      auto& x = ring_[id & (ring_.size() - 1)];
      return x ? &*x : nullptr;
    }
    if (stragglers_.empty()) return nullptr;
    auto i = stragglers_.find(id);
    return i == stragglers_.end() ? nullptr : &i->second;
  }
  const piece* find(std::uint64_t id) const {
    return const_cast<basic_inflight_table*>(this)->find(id);
  }
  /// Removes a piece (answered, or its job ended); returns it.
  std::optional<piece> take_out(std::uint64_t id) {
    std::optional<piece> x;
    if (in_window(id)) {
      auto& slot = ring_[id & (ring_.size() - 1)];
      if (!slot) return std::nullopt;
      x = std::move(slot);
      slot.reset();
      --in_ring_;
      // The window starts at its oldest piece alive.
      while (base_ < next_id_ && !ring_[base_ & (ring_.size() - 1)]) ++base_;
    } else {
      auto i = stragglers_.find(id);
      if (i == stragglers_.end()) return std::nullopt;
      x = std::move(i->second);
      stragglers_.erase(i);
    }
    if (!queue_.empty()) queue_.erase({x->first, id});
    return x;
  }
  /// Producer `p` will not answer `id` (lost, stuck): when nobody else holds it, it is queued
  /// again. Returns true when it was queued.
  bool drop_holder(std::uint64_t id, std::size_t p) {
    auto* x = find(id);
    if (!x) return false;
    auto& h = x->holders;
    h.erase(std::remove(h.begin(), h.end(), p), h.end());
    if (!h.empty()) return false;
    queue_.emplace(x->first, id);
    return true;
  }
  /// The queued piece producer `p` should take at `now`: the oldest ready one, not one whose
  /// item threw on `p` unless `any_producer`. Removed from the queue; the caller sends it.
  std::optional<std::uint64_t> take_queued(std::size_t p, clock_type::time_point now,
                                           bool any_producer) {
    for (auto i = queue_.begin(); i != queue_.end(); ++i) {
      auto& x = at(i->second);
      if (x.not_before > now) continue;
      if (!any_producer && x.avoid && *x.avoid == p) continue;
      auto id = i->second;
      queue_.erase(i);
      return id;
    }
    return std::nullopt;
  }
  [[nodiscard]] bool has_queued(std::size_t p, clock_type::time_point now,
                                bool any_producer) const {
    for (auto& [first, id] : queue_) {
      auto& x = at(id);
      if (x.not_before <= now && (any_producer || !x.avoid || *x.avoid != p)) return true;
    }
    return false;
  }
  /// The earliest time a queued piece waits for (a retry's backoff), if any waits.
  [[nodiscard]] std::optional<clock_type::time_point> next_wakeup(
      clock_type::time_point now) const {
    std::optional<clock_type::time_point> t;
    for (auto& [first, id] : queue_) {
      auto nb = at(id).not_before;
      if (nb > now && (!t || nb < *t)) t = nb;
    }
    return t;
  }
  /// For an idle producer `p`: the oldest piece held by exactly one other producer.
  [[nodiscard]] std::optional<std::uint64_t> copy_for(std::size_t p) const {
    std::optional<std::uint64_t> best;
    std::uint64_t best_first = 0;
    auto consider = [&](std::uint64_t id, const piece& x) {
      if (x.holders.size() == 1 && x.holders[0] != p && !x.trimming &&
          (!best || x.first < best_first)) {
        best = id;
        best_first = x.first;
      }
    };
    for (auto& [id, x] : stragglers_) consider(id, x);
    for (auto id = base_; id < next_id_; ++id)
      if (auto& x = ring_[id & (ring_.size() - 1)]) consider(id, *x);
    return best;
  }
  [[nodiscard]] std::size_t size() const noexcept { return in_ring_ + stragglers_.size(); }
  [[nodiscard]] bool empty() const noexcept { return size() == 0; }
  [[nodiscard]] std::size_t queued() const noexcept { return queue_.size(); }
  /// The ring's slots (a test bounds them against size()).
  [[nodiscard]] std::size_t ring_slots() const noexcept { return ring_.size(); }

 private:
  const piece& at(std::uint64_t id) const {
    auto* x = find(id);
    if (!x) throw std::logic_error("inflight_table: a queued piece is gone");
    return *x;
  }
  bool in_window(std::uint64_t id) const noexcept { return id >= base_ && id < next_id_; }
  /// Id `id` does not fit in the ring: the pieces far behind move to stragglers_ when they are
  /// few against the window's width, else the ring doubles.
  void make_room(std::uint64_t id) {
    auto width = id - base_ + 1;
    if (ring_.size() >= 64 && width > 4 * in_ring_) {
      while (id - base_ + 1 > std::max<std::uint64_t>(2 * in_ring_, 1) && base_ < id) {
        auto& slot = ring_[base_ & (ring_.size() - 1)];
        if (slot) {
          stragglers_.emplace(base_, std::move(*slot));
          slot.reset();
          --in_ring_;
        }
        ++base_;
      }
      while (base_ < id && !ring_[base_ & (ring_.size() - 1)]) ++base_;
      if (id - base_ < ring_.size()) return;
    }
    auto size = std::max<std::size_t>(8, ring_.size());
    while (size < id - base_ + 1) size *= 2;
    if (size == ring_.size()) size *= 2;
    std::vector<std::optional<piece>> bigger(size);
    for (auto i = base_; i < id; ++i)
      if (auto& slot = ring_[i & (ring_.size() - 1)]) bigger[i & (size - 1)] = std::move(slot);
    ring_ = std::move(bigger);
  }

  /// ring_[id & (size - 1)]: the piece of id, for ids in [base_, next_id_); a power of two.
  std::vector<std::optional<piece>> ring_;
  std::uint64_t base_ = 0;
  std::size_t in_ring_ = 0;                                  ///< pieces alive in ring_
  std::unordered_map<std::uint64_t, piece> stragglers_;      ///< ids below base_
  std::set<std::pair<std::uint64_t, std::uint64_t>> queue_;  ///< (first index, id)
  std::uint64_t next_id_ = 0;
};

using reorder_window = basic_reorder_window<troupe::batch>;
using piece = basic_piece<troupe::batch>;
using inflight_table = basic_inflight_table<troupe::batch>;

}  // namespace troupe::detail
