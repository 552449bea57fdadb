// Which chunk an idle producer takes items from (options::split_late_chunks): a pure part of
// the scheduler (no CAF, no clock: the times come in as numbers), unit-tested on its own
// (tests/split_units_test.cpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace troupe::detail {

/// A chunk on another producer, as the scheduler sees it when a producer falls idle.
struct split_candidate {
  std::size_t position = 0;      ///< in its producer's queue (0: the one it works on now)
  std::uint64_t unclaimed = 0;   ///< items not claimed by its producer (chunk_cut::unclaimed)
  std::uint64_t claimed = 0;     ///< items claimed (started, or in the producer's current grab)
  double model_ns_per_item = 0;  ///< the job's cost per item there, as learned (0: unknown)
  double expected_ns = 0;        ///< the chunk's expected time, as learned
  double elapsed_ns = 0;         ///< position 0: since its producer could start it
  /// Position 0: its recent pace, the time per item claimed since the scheduler last looked
  /// (at least the time since then when none was); 0: not known.
  double recent_ns_per_item = 0;
  /// Position > 0: how long it will wait for the chunks ahead of it at least, when the one its
  /// producer works on runs late (that one's time so far: it may be stuck); else 0.
  double wait_ns = 0;
};

/// What to do with candidate `index`: take back the later half of its unclaimed items, or all
/// of them (`all`: a chunk behind others in its producer's queue), or, when every item is
/// claimed but the chunk runs late, ask its producer for the claimed items it has not started
/// (`ask`).
struct split_choice {
  std::size_t index = 0;
  bool all = false;
  bool ask = false;
};

/// The time a candidate's unclaimed items will take on its producer: by the job's cost per
/// item there, or, for the chunk being worked, by how long its claimed items have taken so far
/// or its recent pace, when slower (items slower than learned: a slow patch).
inline double unclaimed_ns(const split_candidate& c) {
  auto per_item = c.model_ns_per_item;
  if (c.position == 0 && c.claimed > 0)
    per_item =
        std::max({per_item, c.elapsed_ns / static_cast<double>(c.claimed), c.recent_ns_per_item});
  return per_item * static_cast<double>(c.unclaimed);
}

/// Whether the chunk being worked runs late: over twice its expected time, and over `floor_ns`.
/// Its producer is then asked for the claimed items it has not started (a grab of items that
/// looked trivial may hold slow ones), whatever else is taken from it.
inline bool runs_late(const split_candidate& c, double floor_ns) {
  return c.position == 0 && c.claimed > 0 && c.elapsed_ns > std::max(floor_ns, 2 * c.expected_ns);
}

/// The candidate whose unclaimed items would be done last (the time they wait behind a late
/// chunk, then their own), when that is at least `floor_ns` (less is not worth a chunk's
/// messages); else, a chunk being worked whose items are all
/// claimed and which has run over twice its expected time and `floor_ns`: its producer is asked
/// for the items it has not started. Nothing when neither.
inline std::optional<split_choice> choose_split(const std::vector<split_candidate>& cs,
                                                double floor_ns) {
  std::optional<split_choice> best;
  double most = floor_ns;
  for (std::size_t i = 0; i < cs.size(); ++i) {
    auto& c = cs[i];
    // Nothing to take; or the one item of a chunk its producer has not begun (moving it
    // gains nothing: two idle producers would pass it back and forth).
    if (c.unclaimed == 0 || (c.position == 0 && c.claimed == 0 && c.unclaimed == 1)) continue;
    auto ns = c.wait_ns + unclaimed_ns(c);
    if (ns >= most) {
      most = ns;
      best = split_choice{i, c.position > 0, false};
    }
  }
  if (best) return best;
  for (std::size_t i = 0; i < cs.size(); ++i) {
    auto& c = cs[i];
    if (c.unclaimed == 0 && c.claimed > 1 && runs_late(c, floor_ns))
      return split_choice{i, false, true};
  }
  return std::nullopt;
}

}  // namespace troupe::detail
