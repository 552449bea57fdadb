// The statistics a runner's scheduler keeps and its callers read (runner::stats()).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>

#include "troupe/detail/introspect.hpp"
#include "troupe/options.hpp"

namespace troupe::detail {

/// Statistics shared between the scheduler and the caller.
struct stats_box {
  std::mutex mtx;
  troupe::stats value;
  /// Items of running jobs (of known size) not yet pulled for a producer: what
  /// options::max_queued_items bounds. submit() adds, the scheduler takes away.
  std::atomic<std::uint64_t> queued{0};
  /// Bumped whenever a producer's alive or removed changes: devices() publishes again.
  std::atomic<std::uint64_t> presence{0};
  // For observers (under mtx, touched by the scheduler once per chunk and per job):
  seconds_histogram chunk_seconds{
      {0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30}};
  seconds_histogram job_seconds{{0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 60, 300, 3600}};
  double last_item_unix_seconds = 0;
  /// Chunks handed to producers: every send (retries, re-dispatches and copies included), and
  /// of those the first sends, whose wait queue_wait holds.
  std::uint64_t retries = 0;        ///< items tried again (error_policy::retry)
  std::uint64_t skipped_items = 0;  ///< items skipped after failing (error_policy::skip)
  /// Items' payload to and from producers on nodes (numbers, tensors, strings: flat_bytes()),
  /// and chunks of other types, whose size is not known without serializing them.
  std::uint64_t node_bytes_sent = 0;
  std::uint64_t node_bytes_received = 0;
  std::uint64_t node_chunks_unsized = 0;
  std::uint64_t chunks_sent = 0;
  std::uint64_t chunks_first_sent = 0;
  seconds_histogram queue_wait{
      {0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 300}};
  /// Dynamic batching: how long each call was held for more items (stats::longest_batch_hold).
  seconds_histogram batch_hold{{0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1}};
};

}  // namespace troupe::detail
