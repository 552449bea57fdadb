// One job on the scheduler (scheduler.hpp), from submit() until it ends.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>

#include "scheduler_parts.hpp"
#include "troupe/detail/job_core.hpp"
#include "troupe/detail/job_gate.hpp"
#include "troupe/detail/source.hpp"
#include "troupe/job_options.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

/// One job, from submit() until it ends. Dropped as a whole when it ends.
struct job_state {
  std::uint64_t id = 0;
  std::shared_ptr<job_core> core;
  std::shared_ptr<input_source> source;
  bool ordered = false;
  job_options opts;
  bool fold = false;              ///< work_chunk::fold for its chunks
  std::uint64_t queued_left = 0;  ///< its items still counted in stats_box::queued
  std::uint64_t next_item = 0;    ///< index of the next item to pull
  /// Items with troupe_cost: the cost of one unit of the job's cost model (the mean cost of the
  /// items of its first chunk, then fixed: units stay comparable from chunk to chunk); 0: none
  /// pulled yet.
  double cost_unit = 0;
  /// The units and items pulled so far (troupe_cost): the limits counted in items (the job's
  /// share, max_chunk_items) become units through their ratio. An item stated 1,000 times
  /// cheaper than the others as the first one made every chunk 1,000 times too short.
  double units_pulled = 0;
  std::uint64_t items_costed = 0;
  /// Units per item so far (1 without troupe_cost).
  [[nodiscard]] double units_per_item() const {
    return items_costed > 0 && units_pulled > 0 ? units_pulled / static_cast<double>(items_costed)
                                                : 1.0;
  }
  std::uint64_t consumed = 0;  ///< items its consumer took, as read from its gate
  bool exhausted = false;
  bool ending = false;  ///< its last outputs (or end_of_input) sent: consumer::end() next
  std::uint64_t chunks_to_consumer = 0;  ///< consume_chunk messages sent
  /// The consumer's chunks taken (job_gate::chunk_done) that the scheduler has read.
  std::uint64_t chunks_read = 0;
  /// Chunks sent to the consumer and not yet read as taken.
  [[nodiscard]] std::uint64_t backlog() const { return chunks_to_consumer - chunks_read; }
  bool last_sent = false;              ///< the chunk with consumer::end() has gone
  bool ack_wanted = false;             ///< as told to the gate (job_gate::want_ack)
  std::deque<batch> pending;           ///< outputs held back while backlog is at consumer_backlog
  std::shared_ptr<job_gate> gate;      ///< shared with the consumer and the handle
  std::uint64_t sent_to_consumer = 0;  ///< outputs sent to the consumer
  /// Its last outputs are on their way with consumer::end(): its report, progress and stats are
  /// final already, and the consumer finishes the job itself once end() has returned.
  bool concluded = false;
  inflight_table pieces;
  reorder_window reorder;
  job_report report;
  clock_type::time_point started;
  clock_type::time_point last_progress;
};

}  // namespace troupe::detail
