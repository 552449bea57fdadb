// What a producer's typed work loop hands back to its (untyped) actor: the outputs of one chunk,
// or its first failure, or the items that threw when the job goes on after failures.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "troupe/batch.hpp"

namespace troupe {

/// An item that threw, in a chunk_result of a work_chunk with keep_going.
struct item_error {
  std::uint64_t index = 0;  ///< the item's index in the job's input
  std::string what;
};

namespace detail {

struct work_outcome {
  batch outputs;                     ///< the outputs of the items that worked, in order
  std::vector<item_error> failures;  ///< keep_going: the items that threw
  bool failed = false;               ///< an item threw and the chunk ended there
  bool wrong_type = false;           ///< the chunk holds items of another type than the job's
  bool revoked = false;  ///< a part of a caller's range whose job ended: the chunk was given up
  /// Folding (work_chunk::fold): a member of the producer's own consumer threw (`what` says
  /// which and why); the job ends with consumer_error.
  bool consumer_failed = false;
  /// Batch producers: work(span) calls made on halves of a batch that threw.
  std::uint64_t extra_calls = 0;
  std::uint64_t failed_index = 0;  ///< failed: the item's index in the job's input
  std::string what;                ///< failed: its message
};

}  // namespace detail
}  // namespace troupe
