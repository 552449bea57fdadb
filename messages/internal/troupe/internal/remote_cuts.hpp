// Chunks that producers in this process work for a coordinator in another process, by producer
// and cut id (options::split_late_chunks on nodes). A producer's own mailbox is busy while it
// works, so a coordinator's trim reaches the chunk through the node's actor instead, which
// moves the chunk's end here; the producer reads it before each item, as a local one does.
// Cut ids grow in the order a coordinator sends a producer its chunks (and CAF delivers them in
// that order), so a trim for a chunk not started yet is told from one already answered. No CAF.
#pragma once

#include <cstdint>
#include <memory>

#include "troupe/detail/chunk_cut.hpp"

namespace troupe::detail::remote_cuts {

/// The producer (its actor's id) is about to work chunk `cut_id` of `items` items: its cut,
/// trimmed already if a trim came first.
std::shared_ptr<chunk_cut> start(std::uint64_t producer, std::uint64_t cut_id, std::uint64_t items);

/// The producer has answered chunk `cut_id`.
void finish(std::uint64_t producer, std::uint64_t cut_id) noexcept;

/// The producer's actor has ended.
void forget(std::uint64_t producer) noexcept;

/// A coordinator takes back items of chunk `cut_id` (`items` items) that its producer has not
/// claimed: all of them, or the later half (chunk_cut::trim). The items the producer keeps
/// ([0, result)), or -1 when nothing was taken (every item claimed: the producer is then asked
/// for those it has not started; or the chunk answered already). `ask`: the chunk runs late,
/// and its producer is asked for the claimed items it has not started in any case (a grab of
/// items that looked trivial may hold slow ones), which a later trim can take.
std::int64_t trim(std::uint64_t producer, std::uint64_t cut_id, std::uint64_t items, bool all,
                  bool ask = false);

/// Chunks known here now (tests).
std::size_t size() noexcept;

}  // namespace troupe::detail::remote_cuts
