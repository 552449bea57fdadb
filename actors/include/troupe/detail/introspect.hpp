// What an observer (troupe::metrics_text, the status page) reads of the runners alive in this
// process: snapshots, taken under each runner's own locks. No CAF header here.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "troupe/detail/published.hpp"
#include "troupe/device.hpp"
#include "troupe/options.hpp"

namespace troupe::detail {

/// A histogram of seconds with fixed bucket bounds (Prometheus' le, upper bounds inclusive).
struct seconds_histogram {
  std::vector<double> bounds;         ///< ascending upper bounds; +Inf is implicit
  std::vector<std::uint64_t> counts;  ///< per bucket (bounds.size() + 1, the last for +Inf)
  double sum = 0;
  std::uint64_t count = 0;

  explicit seconds_histogram(std::vector<double> b = {})
      : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void observe(double seconds) {
    std::size_t i = 0;
    while (i < bounds.size() && seconds > bounds[i]) ++i;
    counts[i] += 1;
    sum += seconds;
    count += 1;
  }
};

/// A running job as an observer sees it (the status page's progress bars).
struct job_snapshot {
  std::uint64_t id = 0;  ///< the runner's job number (1, 2, ... in the order submitted)
  progress now;
};

struct runner_snapshot {
  std::uint64_t id = 0;  ///< the runner's number in this process (1, 2, ...), never reused
  bool open = false;
  bool simulated = false;
  std::vector<device> devices;  ///< present now
  troupe::stats stats;
  std::uint64_t jobs_submitted = 0;
  /// Items of running jobs (of known size) not yet handed to a producer.
  std::uint64_t queued_items = 0;
  /// Time producers spent on each chunk (one observation per chunk answered).
  seconds_histogram chunk_seconds;
  /// Time from submit() to the job's end (one observation per job ended).
  seconds_histogram job_seconds;
  /// When the last output was worked (unix seconds; 0: none yet): stalls show as its age.
  double last_item_unix_seconds = 0;
  std::uint64_t retries = 0;        ///< items tried again after work() threw on them
  std::uint64_t skipped_items = 0;  ///< items skipped after failing (error_policy)
  /// Payload bytes of items sent to producers on nodes and of outputs received from them (flat
  /// types); chunks to nodes whose items have no flat size.
  std::uint64_t node_bytes_sent = 0;
  std::uint64_t node_bytes_received = 0;
  std::uint64_t node_chunks_unsized = 0;
  /// Chunks handed to producers (every send) and first sends (of each chunk once).
  std::uint64_t chunks_sent = 0;
  std::uint64_t chunks_first_sent = 0;
  /// How long a chunk's items waited before its first send: from the job's start for inputs of
  /// known size (their items are there from submit()), none for generators (pulled when sent).
  seconds_histogram queue_wait;
  /// Dynamic batching: how long each call was held for more items (one observation per call).
  seconds_histogram batch_hold;
  /// Running jobs, oldest first, at most running_jobs_listed of them.
  std::vector<job_snapshot> running_jobs;
  static constexpr std::size_t running_jobs_listed = 32;
};

/// What the producers living in this process worked (local producers of its runners, and the
/// producers a node serves for its coordinators): one update per chunk, relaxed atomics.
struct work_totals {
  std::atomic<std::uint64_t> ok_chunks{0};
  std::atomic<std::uint64_t> failed_chunks{0};  ///< answered with an error
  std::atomic<std::uint64_t> items{0};
  std::atomic<std::uint64_t> busy_ns{0};
};
work_totals& process_work() noexcept;

/// What an observer reads of a data_parallel trainer (troupe::torch publishes it after each
/// step and membership change; the metrics library reads it without LibTorch).
struct trainer_view {
  std::uint64_t id = 0;  ///< its number in this process (1, 2, ...), never reused
  std::uint64_t steps = 0;
  std::uint64_t shards = 0;
  std::uint64_t recomputed_shards = 0;
  std::uint64_t lost_replicas = 0;
  std::uint64_t ring_reductions = 0;
  double reduce_seconds = 0;
  double step_seconds = 0;
  std::size_t replicas = 0;  ///< alive now
};
/// Every trainer alive in this process, oldest first.
published_list<trainer_view>& trainers();

/// Every runner alive in this process, oldest first.
std::vector<runner_snapshot> runner_snapshots();

}  // namespace troupe::detail
