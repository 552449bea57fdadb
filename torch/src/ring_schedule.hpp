// The ring all-reduce's schedule, shared by its two transports (the replicas' actors through
// CAF, train_replica_actor.cpp; the data plane, ring_plane.cpp): pure, no LibTorch, no CAF.
// The buffer is cut into `pieces` slices, each all-reduced by a ring of its own; each slice is
// cut into n chunks. Reduce-scatter: at hop 0 member `pos` sends its chunk `pos` to its right
// neighbour; at hop h > 0 it sends what hop h - 1 brought, after adding its own (so chunk k is
// summed in ring order starting at member k: ((x_k + x_k+1) + x_k+2) ...). After n - 1 hops
// member `pos` holds chunk (pos + 1) % n whole; all-gather passes the whole chunks on, copied,
// for n - 1 more hops. Every member then holds the same bits.
#pragma once

#include <cstdint>
#include <utility>

namespace troupe::detail::ring_plane {

/// Elements [first, second) of chunk `k` (of `n`) of piece `piece` (of `pieces`) of a buffer
/// of `numel` elements.
inline std::pair<std::int64_t, std::int64_t> chunk_range(std::int64_t numel, std::uint32_t pieces,
                                                         std::uint32_t n, std::uint32_t piece,
                                                         std::uint32_t k) {
  auto pb = numel * piece / pieces, pe = numel * (piece + 1) / pieces;
  auto len = pe - pb;
  return {pb + len * k / n, pb + len * (k + 1) / n};
}

/// Member `pos` of a ring of `n` (n >= 2): which chunk each hop carries.
struct schedule {
  std::uint32_t n = 2, pos = 0;

  /// Hops each way per piece: n - 1 of reduce-scatter, n - 1 of all-gather.
  [[nodiscard]] std::uint32_t hops() const { return 2 * (n - 1); }
  /// Hop h's chunk from the left is added in (reduce-scatter), else copied (all-gather).
  [[nodiscard]] bool adds(std::uint32_t h) const { return h < n - 1; }
  /// The chunk that hop h brings from the left neighbour.
  [[nodiscard]] std::uint32_t received(std::uint32_t h) const {
    if (h < n - 1) return (pos + 2 * n - h - 1) % n;
    return (pos + 2 * n - (h - (n - 1))) % n;
  }
  /// The chunk that hop h sends to the right neighbour: its own chunk `pos` at hop 0, else
  /// what hop h - 1 brought (once it arrived, and was added in).
  [[nodiscard]] std::uint32_t sent(std::uint32_t h) const { return h == 0 ? pos : received(h - 1); }
  /// Whether what hop h brought is passed on (all but the last all-gather hop's).
  [[nodiscard]] bool passes_on(std::uint32_t h) const { return h + 1 < hops(); }
};

}  // namespace troupe::detail::ring_plane
