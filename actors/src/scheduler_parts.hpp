// The scheduler's bookkeeping, as small classes with their own unit tests
// (tests/units_test.cpp): the reorder window of an ordered job, and the table of a job's pieces
// in flight (which producers hold each one, which wait to be sent again). Templates over the
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

#include "node_pool.hpp"

namespace troupe {
class batch;
}

namespace troupe::detail {

using clock_type = std::chrono::steady_clock;

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

template <class Batch>
class basic_inflight_table {
 public:
  using piece = basic_piece<Batch>;

  /// Adds a piece about to be sent; returns its id.
  std::uint64_t add(piece p) {
    auto id = next_id_++;
    pieces_.emplace(id, std::move(p));
    return id;
  }
  /// Adds a piece to be sent when a producer has room (not before p.not_before).
  std::uint64_t add_queued(piece p) {
    auto id = add(std::move(p));
    queue_.emplace(pieces_.at(id).first, id);
    return id;
  }
  piece* find(std::uint64_t id) {
    auto i = pieces_.find(id);
    return i == pieces_.end() ? nullptr : &i->second;
  }
  /// Removes a piece (answered, or its job ended); returns it.
  std::optional<piece> take_out(std::uint64_t id) {
    auto i = pieces_.find(id);
    if (i == pieces_.end()) return std::nullopt;
    queue_.erase({i->second.first, id});
    auto p = std::move(i->second);
    pieces_.erase(i);
    return p;
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
      auto& x = pieces_.at(i->second);
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
      auto& x = pieces_.at(id);
      if (x.not_before <= now && (any_producer || !x.avoid || *x.avoid != p)) return true;
    }
    return false;
  }
  /// The earliest time a queued piece waits for (a retry's backoff), if any waits.
  [[nodiscard]] std::optional<clock_type::time_point> next_wakeup(
      clock_type::time_point now) const {
    std::optional<clock_type::time_point> t;
    for (auto& [first, id] : queue_) {
      auto nb = pieces_.at(id).not_before;
      if (nb > now && (!t || nb < *t)) t = nb;
    }
    return t;
  }
  /// For an idle producer `p`: the oldest piece held by exactly one other producer.
  [[nodiscard]] std::optional<std::uint64_t> copy_for(std::size_t p) const {
    std::optional<std::uint64_t> best;
    std::uint64_t best_first = 0;
    for (auto& [id, x] : pieces_)
      if (x.holders.size() == 1 && x.holders[0] != p && !x.trimming &&
          (!best || x.first < best_first)) {
        best = id;
        best_first = x.first;
      }
    return best;
  }
  [[nodiscard]] std::size_t size() const noexcept { return pieces_.size(); }
  [[nodiscard]] bool empty() const noexcept { return pieces_.empty(); }
  [[nodiscard]] std::size_t queued() const noexcept { return queue_.size(); }

 private:
  std::unordered_map<std::uint64_t, piece, std::hash<std::uint64_t>, std::equal_to<std::uint64_t>,
                     pool_allocator<std::pair<const std::uint64_t, piece>>>
      pieces_;
  std::set<std::pair<std::uint64_t, std::uint64_t>> queue_;  ///< (first index, id)
  std::uint64_t next_id_ = 0;
};

using reorder_window = basic_reorder_window<troupe::batch>;
using piece = basic_piece<troupe::batch>;
using inflight_table = basic_inflight_table<troupe::batch>;

}  // namespace troupe::detail
