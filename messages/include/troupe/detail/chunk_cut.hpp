// Where a chunk ends, shared by the scheduler and the producer that works it (options::
// split_late_chunks): the producer claims its items a few at a time before it starts them, and
// the scheduler takes back the items not claimed yet for an idle producer. One atomic word holds
// both ends, so every item is either claimed by the producer or taken back by the scheduler,
// never both and never neither, whatever the order in which they get to it. No CAF here.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>

namespace troupe::detail {

class chunk_cut {
 public:
  /// Chunks of more items than this are not cut (they work as before).
  static constexpr std::uint64_t max_items = (std::uint64_t{1} << 31) - 1;

  /// A chunk of `n` items (at most max_items), none claimed.
  explicit chunk_cut(std::uint64_t n) noexcept : state_(pack(n, 0, false)) {}

  // -- the producer's side -----------------------------------------------------------------

  /// Claims up to `want` more items (from next() on): how many it may now start, 0 when the
  /// chunk ends here (every item up to end() is claimed: the rest was taken back).
  std::size_t claim(std::size_t want) noexcept {
    auto s = state_.load(std::memory_order_acquire);
    for (;;) {
      auto nx = next_of(s), e = end_of(s);
      if (nx >= e || want == 0) return 0;
      auto g = std::min<std::uint64_t>(want, e - nx);
      if (state_.compare_exchange_weak(s, pack(e, nx + g, wanted_of(s)), std::memory_order_acq_rel,
                                       std::memory_order_acquire))
        return static_cast<std::size_t>(g);
    }
  }

  /// Items started so far, noted now and then (a relaxed store): the scheduler tells a producer
  /// that works from one stuck in an item.
  void note_started(std::uint64_t n) noexcept { started_.store(n, std::memory_order_relaxed); }

  /// Whether the scheduler asked for claimed items back (it found none unclaimed): a relaxed
  /// load, cheap enough to look at every few items.
  [[nodiscard]] bool wanted() const noexcept {
    return wanted_of(state_.load(std::memory_order_relaxed));
  }

  /// Gives back the items claimed from `from` on (none of them started): next() becomes
  /// `from`, and the scheduler's request is answered. `from` is at most next().
  void release(std::uint64_t from) noexcept {
    auto s = state_.load(std::memory_order_acquire);
    for (;;) {
      auto nx = std::min(from, next_of(s));
      if (state_.compare_exchange_weak(s, pack(end_of(s), nx, false), std::memory_order_acq_rel,
                                       std::memory_order_acquire))
        return;
    }
  }

  // -- the scheduler's side ----------------------------------------------------------------

  /// Asks the producer for the items it claimed and has not started (a chunk running late:
  /// its current grab may hold slow items). They become unclaimed once it looks (wanted()).
  void ask() noexcept { state_.fetch_or(std::uint64_t{1} << 62, std::memory_order_acq_rel); }

  /// Takes back items not claimed yet: all of them (`all`), else the later half (at least one).
  /// Returns the chunk's new end (the items its producer keeps: [0, end)), or nothing when every
  /// item is claimed; then the producer is asked to give back those it has not started
  /// (wanted()), and a later trim may find them.
  std::optional<std::uint64_t> trim(bool all) noexcept {
    auto s = state_.load(std::memory_order_acquire);
    for (;;) {
      auto nx = next_of(s), e = end_of(s);
      if (nx >= e) {
        if (wanted_of(s) ||
            state_.compare_exchange_weak(s, pack(e, nx, true), std::memory_order_acq_rel,
                                         std::memory_order_acquire))
          return std::nullopt;
        continue;
      }
      auto u = e - nx;
      auto take = all ? u : (u + 1) / 2;
      if (state_.compare_exchange_weak(s, pack(e - take, nx, wanted_of(s)),
                                       std::memory_order_acq_rel, std::memory_order_acquire))
        return e - take;
    }
  }

  /// Items started as last noted by the producer.
  [[nodiscard]] std::uint64_t started() const noexcept {
    return started_.load(std::memory_order_relaxed);
  }
  /// Items claimed so far (started, or about to be).
  [[nodiscard]] std::uint64_t next() const noexcept {
    return next_of(state_.load(std::memory_order_acquire));
  }
  /// Where the chunk ends now.
  [[nodiscard]] std::uint64_t end() const noexcept {
    return end_of(state_.load(std::memory_order_acquire));
  }
  /// Items the scheduler could take back now.
  [[nodiscard]] std::uint64_t unclaimed() const noexcept {
    auto s = state_.load(std::memory_order_acquire);
    return end_of(s) - next_of(s);
  }

 private:
  static constexpr std::uint64_t mask = max_items;
  static constexpr std::uint64_t pack(std::uint64_t end, std::uint64_t next, bool wanted) {
    return (end & mask) << 31 | (next & mask) | (wanted ? std::uint64_t{1} << 62 : 0);
  }
  static constexpr std::uint64_t next_of(std::uint64_t s) { return s & mask; }
  static constexpr std::uint64_t end_of(std::uint64_t s) { return (s >> 31) & mask; }
  static constexpr bool wanted_of(std::uint64_t s) { return (s >> 62) & 1; }

  std::atomic<std::uint64_t> state_;
  std::atomic<std::uint64_t> started_{0};
};

}  // namespace troupe::detail
