// Runner options, progress reports and statistics.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "troupe/device.hpp"

namespace troupe {

/// What on_progress receives. Called on an internal thread (the scheduler's), at most every
/// 100 ms per job and once at the end of every successful job; keep it short.
struct progress {
  std::uint64_t done = 0;              ///< items the consumer has received in this job
  std::optional<std::uint64_t> total;  ///< the input's size, when the range knows it
  double items_per_second = 0;
  double elapsed_seconds = 0;
};

/// Something happened to a producer that the application may want to know without a log
/// handler (options::on_event).
struct producer_event {
  enum class kind {
    lost,         ///< its actor or its node died, or the node became unreachable
    timed_out,    ///< busy with one chunk for longer than options::work_timeout
    quarantined,  ///< work() threw options::quarantine_after times in a row
    replaced,     ///< a fresh producer took the place of a lost or timed-out local one
    added,        ///< add_devices: a new producer takes work
    removed,      ///< remove_devices: drained (its chunks finished, end() ran), or lost meanwhile
  };
  kind what = kind::lost;
  /// Its slot: its index in the runner's devices as constructed, then added ones in the order
  /// added (producer_stats::index); a removed producer's slot is never reused.
  std::size_t producer = 0;
  device where;
  std::string reason;  ///< one line, for people
};

/// A plain aggregate: every field has a sensible default.
/// Dynamic batching across callers (options::batching): a producer's call takes items of any
/// running jobs at once (1-item jobs of many callers share one work(span) call); each output
/// returns to its own job. Local producers; a node's get chunks as without it.
struct batching {
  /// 0: off. Else the most items a call takes; a producer is given a batch only when it has
  /// finished the previous one (items wait meanwhile, and the next batch is the fuller).
  std::size_t max_items = 0;
  /// How long an item may wait for others when fewer than max_items wait and the producer is
  /// free (0: never: a lone request is sent at once).
  std::chrono::microseconds max_delay{0};
  /// When this many items (the largest that fits) wait, they go at once, without max_delay.
  std::vector<std::size_t> preferred_sizes;
};

struct options {
  /// Items in flight per producer; 0 = automatic: at least two chunks per producer, more for a
  /// producer whose answers take long to come back (a distant node), so that it always has
  /// about one round trip of work queued.
  std::size_t max_in_flight = 0;
  /// Items per message; 0 = automatic: it adapts so that a chunk takes about
  /// `target_chunk_time` of producer time, from 1 item (slow items) up to `max_chunk_items`
  /// (and `max_chunk_bytes`).
  std::size_t chunk_size = 0;
  std::function<void(const progress&)> on_progress;
  /// Target producer time per chunk when chunk_size is automatic; between 1 us and 1 hour.
  std::chrono::microseconds target_chunk_time{2000};
  /// Upper bound of an automatic chunk, in items.
  std::size_t max_chunk_items = 65536;
  /// A chunk is closed once its items hold this many bytes (memory stays bounded for big items).
  std::size_t max_chunk_bytes = std::size_t{4} << 20;
  /// Ordered runs: at most this many chunks between the oldest undelivered one and the newest
  /// dispatched one (the reorder window); 0 = automatic: room for every producer's queue twice
  /// over, counted in the chunks of the fastest one, at least 4 per producer, at most 256 (or
  /// that floor).
  std::size_t reorder_window = 0;
  /// Chunks sent to the consumer but not yet consumed before dispatch pauses.
  std::size_t consumer_backlog = 4;
  /// A producer that has been working on one chunk this long (measured from when it could
  /// start it: when it was sent, or when the producer answered the chunk ahead of it) is given
  /// up on: stuck in a native call, deadlocked. Its chunks go to the other producers, a late
  /// answer is dropped, and a local producer is replaced by a fresh one on the same device (a
  /// remote one is lost). 0 = never. Off by default because items may legitimately take
  /// minutes; set it above the slowest chunk you expect (a chunk is one item once items take
  /// longer than `target_chunk_time`). A frozen or unreachable node is noticed by heartbeats
  /// within ~1.5 s without it.
  std::chrono::milliseconds work_timeout{0};
  /// Speculative copies of late chunks: when a producer is idle and no job has an item it could
  /// take instead, a chunk that has been on another producer longer than `speculation_after` times
  /// that producer's expected time for it (its measured time per item, times the chunk's items and
  /// those queued ahead of it; at least 10 × target_chunk_time, which alone counts while its
  /// time per item is not known yet) is sent to the idle producer as
  /// well. The first answer wins and the other is dropped, so every output is still delivered
  /// exactly once, but producer::work runs twice for those items (stats::duplicated_items).
  /// A producer that is slow all the time is not late: its chunks are sized to its speed.
  /// Turn it off for jobs whose work() has side effects that must not repeat.
  bool speculative = true;
  /// How late a chunk must be for a speculative copy, in multiples of its expected time (Spark
  /// copies a task at 1.5 × the median; troupe measures each producer on its own).
  double speculation_after = 2.0;
  /// A producer that falls idle (no job has an item for it) takes back part of a chunk that
  /// another producer has not started yet: the later half of its items not started, or
  /// all of them for a chunk queued behind others, when they are worth at least an eighth of
  /// target_chunk_time there (stats::split_chunks, moved_items). Items are claimed before they
  /// start, so each is worked exactly once; a speculative copy is then made only of a chunk
  /// whose items have all started (a producer stuck in one). A node's chunk is trimmed by its
  /// node (a message to the node's actor, stats::trims_sent: the producer's own mailbox is busy
  /// while it works), once the job's cost per item there is known; the items come back to the
  /// next producer with room. Batched calls (options::batching) and chunks folded on their
  /// producer (consumer::merge) are not split.
  bool split_late_chunks = true;
  /// close() and the destructor wait this long, in all, for the producers to finish their
  /// current chunk and run producer::end(); producers still busy then are left behind (their
  /// threads end when work() returns).
  std::chrono::milliseconds close_timeout{5000};
  /// A producer whose work() throws this many times in a row (items of any job) is ended and
  /// taken out of the pool (producer_stats::quarantined); its items go to the others. 0 = never.
  std::size_t quarantine_after = 0;
  /// Called when a producer is lost, timed out, quarantined or replaced (producer_event), on the
  /// scheduler's thread, like on_progress: keep it short; what it throws is ignored.
  std::function<void(const producer_event&)> on_event;
  /// Tests: every chunk crosses the wire format even between local actors (the inputs before
  /// producer::work, the outputs after it), exactly as it would to and from a node, so that a
  /// type whose inspect() forgets a field fails a local test. Needs input and output types
  /// with inspect(); costs a copy of every item both ways.
  bool serialize = false;
  /// 0: no bound. Else submit() (and run(), stream()) throws troupe::overloaded at once, the
  /// job not started, when this many items would be waiting (submitted, of running jobs, not
  /// yet handed to a producer); an input whose size is unknown (a generator, a single-pass
  /// range) is not counted.
  std::size_t max_queued_items = 0;
  /// Dynamic batching across callers (off by default); see troupe::batching.
  troupe::batching batching;
  /// Chrome trace events (JSON that Perfetto and chrome://tracing load) written to this file
  /// while the runner runs, complete once close() returns: a lane per producer, a slice per
  /// chunk worked (job, items, bytes), arrows from dispatch, and instants for retries,
  /// speculative copies, losses and producers added or removed. "" (default): none.
  std::string trace_file;
  /// Events beyond this many bytes are dropped (counted at the end of the file).
  std::size_t trace_max_bytes = std::size_t{100} << 20;
};

struct producer_stats {
  /// Its slot: its place in the runner's devices as constructed (the producer's constructor's
  /// index), then added ones in the order added; never reused.
  std::size_t index = 0;
  device where;
  std::uint64_t items = 0;
  /// Chunks it answered whole (items / chunks: its mean chunk; each is one decision of the
  /// scheduler's and one message each way).
  std::uint64_t chunks = 0;
  std::chrono::nanoseconds busy{0};  ///< time spent inside producer::work
  bool alive = true;
  /// Times this producer was replaced by a fresh one on the same device after it was given up
  /// on (options::work_timeout) or its actor died.
  std::uint64_t restarts = 0;
  /// Taken out of the pool after options::quarantine_after failures in a row.
  bool quarantined = false;
  /// Removed by remove_devices (drained); stats keep its numbers.
  bool removed = false;
};

struct stats {
  std::uint64_t items = 0;        ///< items consumed over every job
  std::uint64_t runs = 0;         ///< jobs (runs) finished: successfully, failed or cancelled
  std::uint64_t failed_runs = 0;  ///< of those, failed, cancelled or past their deadline
  /// Items sent to a second producer as speculative copies (options::speculative): work()
  /// calls beyond one per item, retries aside.
  std::uint64_t duplicated_items = 0;
  /// options::split_late_chunks: chunks whose items not yet started were taken back for an
  /// idle producer, and those items (each still worked once).
  std::uint64_t split_chunks = 0;
  std::uint64_t moved_items = 0;
  /// Trims sent to nodes for their producers' late chunks (each may take items or find them all
  /// started; those taken count in split_chunks and moved_items).
  std::uint64_t trims_sent = 0;
  /// Batch producers (work(troupe::span<const In>)): calls made again on halves of a batch
  /// that threw, to find the items that fail alone.
  std::uint64_t split_calls = 0;
  /// Dynamic batching (options::batching): calls made, and the longest the batcher held one
  /// for more items, from the moment its producer was free and an item waited to the call's
  /// send (at most max_delay, plus the lateness of the scheduler's wake-up on a busy machine).
  std::uint64_t batched_calls = 0;
  std::chrono::nanoseconds longest_batch_hold{0};
  /// Answers dropped because their producer had been given up on before they came (its node
  /// lost or fenced by its cluster, or a stuck producer replaced): the chunk had gone
  /// elsewhere, so its outputs were not delivered twice.
  std::uint64_t late_answers = 0;
  std::vector<producer_stats> producers;
};

}  // namespace troupe
