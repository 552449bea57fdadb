// The scheduler actor: the single owner of the state of every job on a runner. Jobs run at the
// same time on the shared producers; the next chunk for a producer with room comes from the job
// with the least producer time per weight so far (weighted fair share). Per job it pulls input
// as producers have room, keeps the table of pieces in flight (scheduler_parts.hpp: which
// producers hold each one, which wait to be sent again), applies the job's error policy (skip,
// retry on another producer), orders outputs through a bounded reorder window, drives the job's
// consumer, and ends the job at its deadline or when cancelled. Per producer it sizes chunks
// (about target_chunk_time of work), keeps about one round trip of work queued, re-sends the
// work of a lost or stuck producer, replaces stuck local producers, quarantines producers that
// keep throwing, gives an idle producer the items a late chunk's producer has not started
// (split_late, chosen by split_policy.hpp; every item claimed or taken back exactly once through
// the chunk's chunk_cut), and sends a chunk whose producer is stuck in an item to an idle
// producer as well (first answer wins). At close() it ends every job, then the producers.
//
// The scheduler is a core with no actor in it: events come in as calls (a job submitted, a
// producer's answer, a producer lost, a consumer's acknowledgement, a timer, cancel, close) and
// commands go out through scheduler_io (send a chunk, hand outputs to a consumer, end or replace
// a producer, arm a timer), with the time read from it. No CAF type crosses that interface: the
// actor shell (scheduler_actor.cpp) runs the commands with CAF, resolves and splits bulk
// payloads at its edge, and turns CAF's answers and errors into the core's events. The class is
// defined in four files, one per concern: scheduler_dispatch.cpp (which chunk goes to which
// producer, speculation, timers), scheduler_split.cpp (late chunks split for idle producers),
// scheduler_results.cpp (answers, error policies, producer health: give-up, restart,
// quarantine) and scheduler_jobs.cpp (jobs arriving and ending, a job's consumer, its progress,
// close). Its smaller parts, producer_model.hpp, fair_share.hpp, split_policy.hpp and
// scheduler_parts.hpp, are unit-tested on their own.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fair_share.hpp"
#include "fault_points.hpp"
#include "node_pool.hpp"
#include "producer_model.hpp"
#include "scheduler_io.hpp"
#include "scheduler_job.hpp"
#include "scheduler_parts.hpp"
#include "split_policy.hpp"
#include "stats_box.hpp"
#include "trace.hpp"
#include "troupe/detail/job_core.hpp"
#include "troupe/detail/runtime.hpp"
#include "troupe/detail/source.hpp"
#include "troupe/device.hpp"
#include "troupe/error.hpp"
#include "troupe/job_options.hpp"
#include "troupe/log.hpp"
#include "troupe/options.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

inline constexpr int max_restarts_in_row = 3;  ///< per slot and job, without an answer in between
inline constexpr double unknown_ns_per_item = 1000;  ///< fair-share cost of an item before we know

/// A producer: its actor and health, and what the scheduler has learnt of it (producer_model).
struct producer_slot : producer_model {
  device where;
  std::uint64_t gen = 0;      ///< answers of a handle given up on carry an older generation
  std::uint64_t end_gen = 0;  ///< which end request (scheduler-wide) the drain_end timer is for
  int restarts_in_row = 0;
  std::size_t failures_in_row = 0;  ///< items that threw in a row (quarantine)
  /// Its chunks can be cut (options::split_late_chunks): it shares this process's memory, or
  /// its node trims them (trim_remote).
  bool cuts = false;
  clock_type::time_point last_done{};  ///< when its last answer arrived
};

inline model_settings settings_of(const options& o) {
  model_settings s;
  s.chunk_size = o.chunk_size;
  s.max_in_flight = o.max_in_flight;
  s.max_chunk_items = o.max_chunk_items;
  s.target_chunk_time = std::chrono::duration_cast<std::chrono::nanoseconds>(o.target_chunk_time);
  s.max_chunk_bytes = o.max_chunk_bytes;
  s.reorder_window = o.reorder_window;
  // milliseconds::max() means none, as 0 does (it overflowed nanoseconds).
  if (finite_wait(o.work_timeout))
    s.work_timeout = std::chrono::duration_cast<std::chrono::nanoseconds>(o.work_timeout);
  return s;
}

class scheduler {
 public:
  scheduler(scheduler_io& io, std::vector<device> devices, options opts,
            std::shared_ptr<stats_box> stats);

  // -- events ------------------------------------------------------------------------------

  /// A job arrives (its consumer is the shell's business).
  /// `fold`: its consumer has merge(), so local producers may fold its chunks' outputs when it
  /// fails at its first error (work_chunk::fold).
  void start(std::shared_ptr<job_core> core, std::shared_ptr<input_source> source, bool ordered,
             job_options opts, bool fold = false);

  /// job_handle::cancel(): nothing more of the job reaches a producer; answered when done.
  /// A cancel that comes after consumer::end() has begun loses: end()'s value is the result.
  void cancel(std::uint64_t id);

  void timer_fired(scheduler_io::timer t, std::uint64_t id);

  /// A producer's answer to a chunk (bulk payloads already joined).
  void on_result(std::size_t p, std::uint64_t gen, std::uint64_t job, std::uint64_t id,
                 chunk_result& r);
  /// A chunk could not reach producer `p` of generation `gen`, or its actor or node is gone.
  void producer_failed(std::size_t p, std::uint64_t gen, const std::string& why, bool unreachable);
  std::uint64_t generation(std::size_t p) const { return producers_[p].gen; }  ///< slot p's now
  /// Producer `p`'s actor or node is gone (a monitor's message).
  void producer_down(std::size_t p, const std::string& why, bool unreachable);
  /// trim_remote's answer: chunk `id` of `job` on `p` now ends at `kept` (-1: nothing taken).
  void trimmed(std::size_t p, std::uint64_t gen, std::uint64_t job, std::uint64_t id,
               std::int64_t kept);
  void replaced(std::size_t p, std::uint64_t gen);
  void replace_failed(std::size_t p, std::uint64_t gen, const std::string& why);
  /// The consumer's acknowledgement: what it has taken is read from the job's gate
  /// (job_gate::chunk_done, delivered); it is sent for the last chunk and while the job waits
  /// for it.
  void consumer_acked(std::uint64_t job);
  void input_ended(std::uint64_t job);
  void consumer_failed(std::uint64_t job, const std::string& why);
  /// A producer has run producer::end() (or failed to: `why`), at close().
  void producer_ended(std::size_t p, const std::string& why);

  /// close(): ends every job (runner_closed), then every producer (producer::end()), within
  /// options::close_timeout in all (close_timeout_atom); producers still busy then are left
  /// behind. `timed`: this actor keeps that time itself (when nobody waits for `done`); else the
  /// waiting closer sends close_timeout_atom, so that no timer keeps this actor's thread alive
  /// after it has quit.
  void close(std::shared_ptr<std::promise<void>> done, bool timed);

  void close_timed_out();

  /// add_devices: producers on `devices` (constructed already, their handles with the shell)
  /// take slots from producers_.size() on; they take work at once.
  void add_producers(const std::vector<device>& devices);
  /// remove_devices: slots `slots` take no new work; each one's chunks in flight finish, then
  /// producer::end() runs on it (within options::close_timeout, else it is left behind) and
  /// the slot is retired. `done` is set once every one of them is retired (or lost meanwhile),
  /// or at close.
  void drain(const std::vector<std::size_t>& slots, std::shared_ptr<std::promise<void>> done);

 private:
  /// A draining slot with nothing outstanding: producer::end() on it.
  void maybe_end_drained(std::size_t p);
  /// The slot is done with: no work ever again, its actor stopped, the drains waiting for it
  /// told.
  void retire(std::size_t p, const std::string& why);
  /// Slot `p` goes through `e` (slot_state's next()); returns its state before.
  slot_state move(std::size_t p, slot_event e) {
    auto before = producers_[p].state;
    producers_[p].state = next(before, e);
    count_remote(producers_[p], before);
    return before;
  }
  /// settings_.remote_producers follows slot `s`'s change from `before` (its state now).
  void count_remote(const producer_slot& s, slot_state before) {
    if (s.local || (before == slot_state::working) == (s.state == slot_state::working)) return;
    if (s.state == slot_state::working)
      settings_.remote_producers += 1;
    else
      settings_.remote_producers -= 1;
  }
  clock_type::time_point clock_now() { return io_.now(); }

  void deadline_passed(std::uint64_t id);

  /// options::work_timeout: gives up on producers that have been on one chunk too long.
  void check_stalls();

  // -- dispatch --------------------------------------------------------------------------

  void schedule_stall_check();

  /// The reorder window in chunks (reorder_window_chunks).
  std::size_t window() const { return reorder_window_chunks(producers_, settings_); }

  bool consumer_has_room(const job_state& j) const;

  bool window_open(const job_state& j) const;

  std::size_t chunk_limit(const producer_slot& s) const { return s.chunk_limit(settings_); }
  /// Items in job `job`'s next chunk to `s`, at most (the job's own cost model there).
  std::size_t chunk_limit(const producer_slot& s, std::uint64_t job) const {
    return s.chunk_limit(settings_, job);
  }
  /// A chunk of a caller's lent range for a job that folds (job_state::fold) on a local
  /// producer holds neither items nor outputs (a view in, a consumer object out): only time
  /// bounds it, not max_chunk_items or max_chunk_bytes. About target_chunk_time of the
  /// producer's time, at most half of each live producer's share of the items left (the last
  /// chunks smaller, so the producers finish together: guided self-scheduling), at least a 40th
  /// of target_chunk_time (or chunk_limit(s) when that is smaller).
  std::size_t folded_chunk_limit(const job_state& j, const producer_slot& s) const;
  /// Items in job `j`'s next chunk to `s`: its own cost model's, or, for a job not seen yet
  /// while more jobs are open than producers, the producer's estimate from the other jobs.
  std::size_t new_job_limit(const job_state& j, const producer_slot& s) const;

  bool has_room(const producer_slot& s) const { return s.has_room(settings_); }

  /// Slot `p`'s queue, items, model or health changed: its place in room_ is looked at again
  /// before the next pass. Every such change calls this (fault_points::check_indexes checks).
  void room_changed(std::size_t p) {
    room_dirty_.push_back(p);
    any_cuts_ = any_cuts_ || producers_[p].cuts;
  }
  /// Applies the changes to room_ (not during a pass, which reads it: in_pass_).
  void update_room();
  /// fault_points::check_indexes: room_ against a scan of every producer (std::logic_error).
  void check_room() const;

  /// Whether speculate() or split_late() may find a late chunk now (false while both know
  /// nothing can be late before a later time).
  bool late_chunks_possible(clock_type::time_point now) const;

  /// Whether a retry that threw on `p` may go back to it: no other producer can take work.
  bool only_choice(std::size_t p) const;

  bool has_work_for(const job_state& j, std::size_t p, clock_type::time_point now) const;

  /// Whether `j` may have work for some producer: queued pieces, or items to pull.
  bool may_have_work(const job_state& j) const;

  /// Keeps the indexes of `j` current (after anything about it changed) and settles it at the
  /// end of this event (its outputs to its consumer, its end).
  void touch(job_state& j);

  /// Every event ends here. Its cost grows with the producers and the jobs this event touched,
  /// not with the number of jobs running.
  void pump();

  /// The jobs touched since the last settle(): outputs to their consumers, their end.
  void settle();

  /// Sends producer `p` its next chunk: from the job with the least pass that has work for it;
  /// else, when it is idle (no job has an item it could take instead), a copy of a late chunk.
  /// False when there is none.
  bool dispatch_to(std::size_t p, clock_type::time_point now);

  /// options::speculative: an idle producer takes a copy of a late chunk (first answer wins):
  /// one outstanding longer than options::speculation_after times its producer's expected time
  /// for it (at least 10 target chunk times, and those only when its time per item is not known
  /// yet), and only when `p` has nothing else to do.
  bool speculate(std::size_t p, clock_type::time_point now);

  /// options::split_late_chunks: an idle producer `p` takes back part of a chunk another
  /// producer has not started (split_policy.hpp chooses which), or asks a late chunk's producer
  /// for the items it claimed and has not started. False when nothing was sent.
  bool split_late(std::size_t p, clock_type::time_point now);

  /// Items [keep, n) of chunk `rec` on `q` (taken back from its cut) become a piece of their
  /// own, sent to `p`, or queued for the next producer with room (a node's trim: no `p`).
  void split_piece(job_state& j, std::size_t q, sent_chunk& rec, std::uint64_t keep,
                   std::optional<std::size_t> p);
  /// A node's chunk `rec` on `q` ends at `kept` (the trim's answer, or the chunk's own).
  void apply_trim(std::size_t q, sent_chunk& rec, std::int64_t kept);

  /// `limit`: at most this many new items (options::batching), else the producer's chunk limit.
  bool dispatch_from(job_state& j, std::size_t p, clock_type::time_point now,
                     std::optional<std::size_t> limit = std::nullopt);

  /// options::batching, a local producer that is free: up to max_items items of the running
  /// jobs (in fair-share order) as one group of chunks, worked in one call. Fewer are sent when
  /// a preferred size is reached, or when the oldest waiting job has waited max_delay (a wakeup
  /// is set until then). False when nothing was sent.
  bool dispatch_batch(std::size_t p, clock_type::time_point now);
  [[nodiscard]] bool batching() const { return opts_.batching.max_items > 0; }

  /// `first_wait`: a chunk's first send, how long its items waited (the queue-wait histogram).
  void send(std::size_t p, job_state& j, std::uint64_t id,
            std::optional<clock_type::duration> first_wait = std::nullopt);

  /// Wakes this actor at `t` (a retry's backoff ends, a chunk becomes late), 100 us late; a
  /// time already passed, 100 us from now (the caller read the clock earlier in this event, and
  /// the thread may have been preempted since: a wakeup dropped for that would leave an ordered
  /// job whose only way on is a speculative copy waiting for an event that never comes).
  void wake_at(clock_type::time_point t);

  // -- results -----------------------------------------------------------------------------

  /// Counts the items that threw in a row on `s`; true when it reaches quarantine_after.
  bool count_failures(producer_slot& s, const chunk_result& r, std::size_t n, std::uint64_t first);

  /// How a job whose range its handle took back ends (its cancel is on its way).
  static std::exception_ptr taken_back(std::uint64_t job);
  /// Why a producer's answer to `x` cannot be right (outputs and failures do not add up to
  /// its items, failures out of order or outside it), or nothing.
  static std::optional<std::string> malformed(const piece& x, const chunk_result& r);
  /// Items of piece `x` threw (a job with skip or retry): each is retried, skipped or ends the
  /// job; the outputs of the others are delivered around them.
  void handle_failures(job_state& j, std::size_t p, piece x, chunk_result& r);
  /// Outputs [out, out + n) of `outputs` are items [first, first + n) of `j`.
  void deliver_part(job_state& j, std::uint64_t first, std::size_t n, const batch& outputs,
                    std::size_t out);
  /// A piece's outputs, all of its items.
  void deliver(job_state& j, std::uint64_t first, std::size_t n, batch outputs);
  void release(job_state& j);

  /// Tells options::on_event (on this thread; what it throws is ignored).
  void emit(producer_event::kind kind, std::size_t p, std::string reason);

  /// A producer is lost (its actor or node died) or stuck (work_timeout): its chunks go to the
  /// others, its late answers are dropped, and a local one is replaced by a fresh one.
  /// `why`: what happened; `unreachable`: its node went silent.
  void give_up(std::size_t p, const std::string& why, bool unreachable, bool quarantine = false,
               producer_event::kind kind = producer_event::kind::lost);

  void quarantine_producer(std::size_t p);

  /// `n` of `j`'s items are no longer waiting (pulled for a producer, or the job ended).
  void unqueue(job_state& j, std::uint64_t n) {
    n = std::min(n, j.queued_left);
    j.queued_left -= n;
    stats_->queued -= n;
  }

  /// Producer `p`'s chunks in flight go back to their jobs' queues (for the others).
  void requeue_outstanding(std::size_t p);

  /// A fresh slot for a producer on `d`.
  producer_slot make_slot(std::size_t p, const device& d) const;

  /// Starts a fresh producer on the device of slot `p`; it takes work once constructed.
  void restart(std::size_t p);

  /// Fails every job with node_error when no producer is left to take work.
  void check_survivors();

  // -- consumer ------------------------------------------------------------------------------

  /// Outputs for the consumer: sent at the end of this event (flush_consumer), at most
  /// options::consumer_backlog chunks unacknowledged; the rest wait here.
  void send_to_consumer(job_state& j, batch outputs) { j.pending.push_back(std::move(outputs)); }

  /// Whether every output of `j` is through the producers and the reorder window.
  static bool all_through(const job_state& j);
  void flush_consumer(job_state& j);
  /// Reads what the consumer has taken since the last look (its gate's counts): room in its
  /// backlog, progress, stats. Whether it took anything.
  bool read_consumer(job_state& j);
  /// Every 100 ms while a consumer has chunks not yet read: what it took reaches progress and
  /// stats() although no answer comes (a producer held in a long item, say).
  void read_consumers();
  /// A consumer_read timer, unless one is on its way.
  void read_consumers_later();
  static constexpr std::chrono::milliseconds consumer_read_period{100};
  bool read_timer_ = false;  ///< a consumer_read timer is on its way

  /// The job's last outputs go to its consumer with consumer::end(): what get() shows once it
  /// returns (report, progress, stats) is made final now, so that the consumer can finish the
  /// job itself, without a round trip through this actor. Undone (counted as failed) when end()
  /// throws.
  void conclude(job_state& j);

  void publish_report(job_state& j);
  void report_progress(job_state& j, bool final);

  // -- the end of a job ----------------------------------------------------------------------

  void maybe_finish(std::uint64_t id);

  /// Ends job `id` (e: nullptr on success): its state is dropped, answers still on their way
  /// are dropped when they come, and its handle wakes up. Its consumer is disposed of by the
  /// thread that waits for the job, before get() returns.
  void end_job(std::uint64_t id, std::exception_ptr e);

  void ended_one();

  void finish_close();

  scheduler_io& io_;
  options opts_;
  model_settings settings_;  ///< what producer_model reads of opts_
  std::shared_ptr<stats_box> stats_;
  std::vector<producer_slot> producers_;
  bool closing_ = false;
  std::size_t pending_ends_ = 0;
  std::shared_ptr<std::promise<void>> close_promise_;
  std::map<std::uint64_t, std::unique_ptr<job_state>> jobs_;  ///< running, oldest first
  /// So that an event costs the same with 10 or 10,000 jobs running: the jobs by fair-share
  /// pass (those that may have work for a producer apart), and the jobs this event changed.
  fair_share share_;
  std::vector<std::uint64_t> touched_;
  /// The producers with room by load (producer_model::load, then slot): a pass reads the ones
  /// with room in order instead of sorting every producer, so that an event costs what the
  /// producers it changed do, not O(P log P). room_at_: each slot's key in room_, if there.
  using room_key = std::tuple<double, std::size_t, std::size_t>;
  std::set<room_key, std::less<room_key>, pool_allocator<room_key>> room_;  ///< node_pool.hpp
  std::vector<std::optional<decltype(room_)::iterator>> room_at_;
  std::vector<std::size_t> room_dirty_;
  bool in_pass_ = false;     ///< pump() is reading room_
  bool pass_again_ = false;  ///< pump() was called during a pass: one more pass after it
  bool any_cuts_ = false;    ///< some producer's chunks can be split (producer_slot::cuts)
  std::optional<clock_type::time_point> speculation_check_;  ///< a wakeup to look for late chunks
  /// speculate() found no late chunk: none can be before this time (reset by every send).
  std::optional<clock_type::time_point> nothing_late_before_;
  /// split_late() found nothing worth taking: it looks again at this time (reset by a send).
  std::optional<clock_type::time_point> no_split_before_;
  std::optional<clock_type::time_point> split_check_;  ///< a wakeup to look again
  std::uint64_t next_cut_id_ = 0;    ///< the last work_chunk::cut_id given; and trim_remote
  std::size_t trims_in_flight_ = 0;  ///< commands not answered yet
  /// dispatch_batch: the group being assembled (send() adds to it instead of sending).
  struct grouped_chunk {
    std::size_t p;
    std::uint64_t gen, id;
    work_chunk msg;
  };
  std::vector<grouped_chunk>* group_ = nullptr;
  std::optional<clock_type::time_point> batch_check_;  ///< a wakeup at a batch's max_delay
  /// remove_devices calls waiting: the slots each waits for, and its promise.
  struct drain_wait {
    std::set<std::size_t> left;
    std::shared_ptr<std::promise<void>> done;
  };
  std::vector<drain_wait> drains_;
  std::uint64_t end_requests_ = 0;  ///< producer_slot::end_gen of the latest drain's end()
  /// options::trace_file, or null. Closed (its end written) before close() returns.
  std::unique_ptr<trace_writer> trace_;
  /// A trace's flow id for chunk `id` of job `job`.
  static std::uint64_t flow_id(std::uint64_t job, std::uint64_t id) {
    return job * 1'000'000'007ull + id;
  }
  /// A moment on producer `p`'s lane of the trace (trace_writer::scheduler_lane: the
  /// scheduler's).
  void trace_instant(std::size_t p, const std::string& name, const std::string& detail) {
    if (trace_) trace_->instant(p, name, detail, clock_now());
  }
  void trace_lane(std::size_t p) {
    if (trace_)
      trace_->lane(p, producers_[p].where.is_local() ? "" : producers_[p].where.node(),
                   producers_[p].where.str());
  }
};

}  // namespace troupe::detail
