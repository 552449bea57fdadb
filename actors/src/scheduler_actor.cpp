// The scheduler actor: the single owner of the state of every job on a runner. Jobs run at the
// same time on the shared producers; the next chunk for a producer with room comes from the job
// with the least producer time per weight so far (weighted fair share). Per job it pulls input
// as producers have room, keeps the table of pieces in flight (scheduler_parts.hpp: which
// producers hold each one, which wait to be sent again), applies the job's error policy (skip,
// retry on another producer), orders outputs through a bounded reorder window, drives the job's
// consumer, and ends the job at its deadline or when cancelled. Per producer it sizes chunks
// (about target_chunk_time of work), keeps about one round trip of work queued, re-sends the
// work of a lost or stuck producer, replaces stuck local producers, quarantines producers that
// keep throwing, and sends a chunk that holds up a job to an idle producer as well (first
// answer wins). At close() it ends every job, then the producers.
#include <algorithm>
#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <memory>
#include <set>

#include "fair_share.hpp"
#include "fault_points.hpp"
#include "producer_model.hpp"
#include "runtime_impl.hpp"
#include "scheduler_parts.hpp"
#include "troupe/detail/messages.hpp"
#include "troupe/error.hpp"
#include "troupe/internal/bulk.hpp"
#include "troupe/log.hpp"

namespace troupe::detail {

std::atomic<void (*)()> fault_points::before_wake{nullptr};
std::atomic<fault_points::planted_bug> fault_points::planted{fault_points::planted_bug::none};

namespace {

constexpr int max_restarts_in_row = 3;        ///< per slot and job, without an answer in between
constexpr double unknown_ns_per_item = 1000;  ///< fair-share cost of an item before we know

/// A producer: its actor and health, and what the scheduler has learnt of it (producer_model).
struct producer_slot : producer_model {
  caf::actor handle;
  device where;
  std::uint64_t gen = 0;  ///< answers of a handle given up on carry an older generation
  bool restarting = false;
  bool quarantined = false;
  int restarts_in_row = 0;
  std::size_t failures_in_row = 0;     ///< items that threw in a row (quarantine)
  clock_type::time_point last_done{};  ///< when its last answer arrived
};

model_settings settings_of(const options& o) {
  model_settings s;
  s.chunk_size = o.chunk_size;
  s.max_in_flight = o.max_in_flight;
  s.max_chunk_items = o.max_chunk_items;
  s.target_chunk_time = std::chrono::duration_cast<std::chrono::nanoseconds>(o.target_chunk_time);
  s.max_chunk_bytes = o.max_chunk_bytes;
  s.reorder_window = o.reorder_window;
  return s;
}

/// One job, from submit() until it ends. Dropped as a whole when it ends.
struct job_state {
  std::uint64_t id = 0;
  std::shared_ptr<job_core> core;
  std::shared_ptr<input_source> source;
  caf::actor consumer;
  bool ordered = false;
  job_options opts;
  std::uint64_t next_item = 0;  ///< index of the next item to pull
  std::uint64_t consumed = 0;
  bool exhausted = false;
  bool ending = false;        ///< its last outputs (or end_of_input) sent: consumer::end() next
  std::size_t backlog = 0;    ///< chunks sent to the consumer, not yet acknowledged
  std::deque<batch> pending;  ///< outputs held back while backlog is at consumer_backlog
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

class scheduler {
 public:
  scheduler(caf::event_based_actor* self, std::vector<caf::actor> producers,
            std::vector<device> devices, options opts, std::shared_ptr<stats_box> stats,
            producer_spawner spawn, config cfg)
      : self_(self),
        opts_(std::move(opts)),
        settings_(settings_of(opts_)),
        stats_(std::move(stats)),
        spawn_(std::move(spawn)),
        cfg_(std::move(cfg)) {
    for (std::size_t i = 0; i < producers.size(); ++i) {
      // CAF 0.17 never fails a request to a dead node: monitors (and heartbeats) tell us.
      self_->monitor(producers[i]);
      producer_slot s;
      s.handle = std::move(producers[i]);
      s.where = devices[i];
      s.local = devices[i].is_local();
      if (opts_.chunk_size) s.chunk_items = opts_.chunk_size;
      producers_.push_back(std::move(s));
    }
    self_->set_down_handler([this](caf::down_msg& dm) {
      for (std::size_t p = 0; p < producers_.size(); ++p)
        if (producers_[p].handle.address() == dm.source && !producers_[p].restarting)
          give_up(p, dm.reason);
    });
    // milliseconds::max() (or anything as long) is "never", like 0.
    if (opts_.work_timeout.count() > 0 && finite_wait(opts_.work_timeout)) schedule_stall_check();
  }

  void start(std::shared_ptr<job_spec> spec) {
    if (closing_) {
      spec->core->finish(
          std::make_exception_ptr(runner_closed("the runner was closed before this job started")));
      return;
    }
    auto j = std::make_unique<job_state>();
    j->id = spec->core->id();
    j->core = std::move(spec->core);
    j->source = std::move(spec->source);
    j->consumer = std::move(spec->consumer);
    j->ordered = spec->ordered;
    j->opts = std::move(spec->opts);
    j->started = clock_now();  // last_progress: never, so the first ack reports at once
    j->gate = j->core->gate();
    auto id = j->id;
    if (j->opts.deadline.count() > 0 && finite_wait(j->opts.deadline))
      self_->delayed_send(self_, j->opts.deadline, deadline_atom::value, id);
    // The consumer's constructor runs with its first message (a throw: that message's error).
    share_.join(id);
    auto& job = *jobs_.emplace(id, std::move(j)).first->second;
    touch(job);
    for (auto& s : producers_) s.restarts_in_row = 0;  // at most max_restarts_in_row per job
    check_survivors();
    pump();
  }

  /// job_handle::cancel(): nothing more of the job reaches a producer; answered when done.
  /// A cancel that comes after consumer::end() has begun loses: end()'s value is the result.
  void cancel(std::uint64_t id) {
    auto i = jobs_.find(id);
    if (i == jobs_.end() || !i->second->gate->stop()) return;
    end_job(id, std::make_exception_ptr(cancelled("job " + std::to_string(id) +
                                                  " was cancelled (job_handle::cancel)")));
    pump();
  }

  void deadline_passed(std::uint64_t id) {
    auto i = jobs_.find(id);
    if (i == jobs_.end() || !i->second->gate->stop()) return;  // end() has begun: it wins
    auto& j = *i->second;
    auto why = "job " + std::to_string(id) + " passed its deadline of " +
               std::to_string(j.opts.deadline.count()) + " ms with " + std::to_string(j.consumed) +
               " output(s) delivered" +
               (j.source->total() ? " of " + std::to_string(*j.source->total()) : std::string{}) +
               "; its remaining items were withdrawn";
    end_job(id, std::make_exception_ptr(deadline_exceeded(why)));
    pump();
  }

  void wakeup() { pump(); }

  /// The actor system's clock: steady_clock in a runner, virtual time in a simulation
  /// (troupe::testing::simulation runs this actor on CAF's test coordinator).
  clock_type::time_point clock_now() const { return self_->home_system().clock().now(); }

  /// options::work_timeout: gives up on producers that have been on one chunk too long.
  void check_stalls() {
    if (closing_) return;
    auto now = clock_now();
    for (std::size_t p = 0; p < producers_.size(); ++p) {
      auto& s = producers_[p];
      if (!s.alive || s.outstanding.empty()) continue;
      // A producer works FIFO: its oldest chunk started when it was sent or when the chunk
      // ahead of it was answered, whichever came later. Time spent queued does not count.
      auto began = std::max(s.outstanding.front().sent, s.last_done);
      if (now - began >= opts_.work_timeout)
        give_up(p,
                make_error(errc::node_error, "busy with one chunk for more than " +
                                                 std::to_string(opts_.work_timeout.count()) +
                                                 " ms (options::work_timeout)"),
                false, producer_event::kind::timed_out);
    }
    schedule_stall_check();
  }

  /// close(): ends every job (runner_closed), then every producer (producer::end()), within
  /// options::close_timeout in all (close_timeout_atom); producers still busy then are left
  /// behind. `timed`: this actor keeps that time itself (when nobody waits for `done`); else the
  /// waiting closer sends close_timeout_atom, so that no timer keeps this actor's thread alive
  /// after it has quit.
  void close(std::shared_ptr<std::promise<void>> done, bool timed) {
    if (closing_) {
      done->set_value();
      return;
    }
    closing_ = true;
    close_promise_ = std::move(done);
    // A job whose consumer::end() has begun is left to deliver its value (until the producers
    // have ended: finish_close ends what is left).
    std::vector<std::uint64_t> ids;
    for (auto& [id, j] : jobs_)
      if (j->gate->stop()) ids.push_back(id);
    for (auto id : ids)
      end_job(id, std::make_exception_ptr(runner_closed("the runner was closed during this job")));
    for (auto& s : producers_) {
      if (!s.alive) {  // stuck, lost or still starting: not waited on
        if (s.handle) self_->send_exit(s.handle, caf::exit_reason::user_shutdown);
        continue;
      }
      ++pending_ends_;
      auto where = s.where.str();
      self_->request(s.handle, caf::infinite, end_atom::value)
          .then([this](const consume_ack&) { ended_one(); },
                [this, where](const caf::error& err) {
                  log(log_level::warn,
                      "ending the producer on " + where + " failed: " + error_text(err));
                  ended_one();
                });
    }
    if (pending_ends_ == 0)
      finish_close();
    else if (timed && finite_wait(opts_.close_timeout))
      self_->delayed_send(self_, opts_.close_timeout, close_timeout_atom::value);
  }

  void close_timed_out() {
    if (!close_promise_) return;
    log(log_level::warn, std::to_string(pending_ends_) +
                             " producer(s) did not finish within options::close_timeout; left "
                             "behind (their threads end when work() returns)");
    finish_close();
  }

 private:
  // -- dispatch --------------------------------------------------------------------------

  void schedule_stall_check() {
    auto period = std::clamp<std::chrono::milliseconds>(
        opts_.work_timeout / 4, std::chrono::milliseconds{10}, std::chrono::milliseconds{1000});
    self_->delayed_send(self_, period, stall_check_atom::value);
  }

  /// The reorder window in chunks (reorder_window_chunks).
  std::size_t window() const { return reorder_window_chunks(producers_, settings_); }

  bool consumer_has_room(const job_state& j) const {
    return j.pending.empty() && j.backlog < opts_.consumer_backlog;
  }

  bool window_open(const job_state& j) const {
    return consumer_has_room(j) && (!j.ordered || j.pieces.size() + j.reorder.size() < window());
  }

  std::size_t chunk_limit(const producer_slot& s) const { return s.chunk_limit(settings_); }

  bool has_room(const producer_slot& s) const { return s.has_room(settings_); }

  /// Live producers with room, the least loaded first.
  std::vector<std::size_t> producers_with_room() const {
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < producers_.size(); ++i)
      if (has_room(producers_[i])) out.push_back(i);
    auto load = [this](std::size_t i) { return producers_[i].load(); };
    std::stable_sort(out.begin(), out.end(),
                     [&](std::size_t a, std::size_t b) { return load(a) < load(b); });
    return out;
  }

  /// Whether a retry that threw on `p` may go back to it: no other producer can take work.
  bool only_choice(std::size_t p) const {
    for (std::size_t i = 0; i < producers_.size(); ++i)
      if (i != p && (producers_[i].alive || producers_[i].restarting)) return false;
    return true;
  }

  bool has_work_for(const job_state& j, std::size_t p, clock_type::time_point now) const {
    if (!consumer_has_room(j)) return false;
    return j.pieces.has_queued(p, now, only_choice(p)) || (!j.exhausted && window_open(j));
  }

  /// Whether `j` may have work for some producer: queued pieces, or items to pull.
  bool may_have_work(const job_state& j) const {
    return consumer_has_room(j) && (j.pieces.queued() > 0 || (!j.exhausted && window_open(j)));
  }

  /// Keeps the indexes of `j` current (after anything about it changed) and settles it at the
  /// end of this event (its outputs to its consumer, its end).
  void touch(job_state& j) {
    share_.set_ready(j.id, may_have_work(j));
    touched_.push_back(j.id);
  }

  /// Every event ends here. Its cost grows with the producers and the jobs this event touched,
  /// not with the number of jobs running.
  void pump() {
    if (closing_) return;
    settle();
    bool sent = true;
    while (sent) {
      sent = false;
      auto now = clock_now();
      for (auto p : producers_with_room())
        if (dispatch_to(p, now)) {
          sent = true;
          break;
        }
    }
    settle();
  }

  /// The jobs touched since the last settle(): outputs to their consumers, their end.
  void settle() {
    while (!touched_.empty()) {
      auto batch_ids = std::move(touched_);
      touched_.clear();
      std::sort(batch_ids.begin(), batch_ids.end());
      batch_ids.erase(std::unique(batch_ids.begin(), batch_ids.end()), batch_ids.end());
      for (auto id : batch_ids) {
        auto ji = jobs_.find(id);
        if (ji == jobs_.end()) continue;
        flush_consumer(*ji->second);
        maybe_finish(id);
      }
    }
  }

  /// Sends producer `p` its next chunk: from the job with the least pass that has work for it;
  /// else, when it is idle (no job has an item it could take instead), a copy of a late chunk.
  /// False when there is none.
  bool dispatch_to(std::size_t p, clock_type::time_point now) {
    auto id = share_.pick(
        [&](std::uint64_t job) { return may_have_work(*jobs_.at(job)); },  // the window, say
        [&](std::uint64_t job) { return has_work_for(*jobs_.at(job), p, now); });
    return id ? dispatch_from(*jobs_.at(*id), p, now) : speculate(p, now);
  }

  /// options::speculative: an idle producer takes a copy of a late chunk (first answer wins):
  /// one outstanding longer than options::speculation_after times its producer's expected time
  /// for it (at least 10 target chunk times, and those only when its time per item is not known
  /// yet), and only when `p` has nothing else to do.
  bool speculate(std::size_t p, clock_type::time_point now) {
    if (!opts_.speculative || !producers_[p].outstanding.empty()) return false;
    auto floor = std::chrono::duration<double, std::nano>(opts_.target_chunk_time).count() * 10;
    job_state* best_job = nullptr;
    std::uint64_t best_id = 0;
    double most_late = 1;             // elapsed / allowed
    std::optional<double> next_late;  // ns from now until the first chunk becomes late
    for (std::size_t q = 0; q < producers_.size(); ++q) {
      auto& s = producers_[q];
      if (q == p || !s.alive || s.outstanding.empty()) continue;
      // A producer works FIFO: its chunks finish one after the other from when it could start
      // the first one.
      auto began = std::max(s.outstanding.front().sent, s.last_done);
      auto elapsed = std::chrono::duration<double, std::nano>(now - began).count();
      double expected = 0;
      for (auto& rec : s.outstanding) {
        expected += static_cast<double>(rec.items) * s.ns_per_item;
        auto allowed = std::max(floor, opts_.speculation_after * expected);
        if (elapsed <= allowed * most_late) {  // this one and those behind it: on time (yet)
          if (!best_job)
            next_late = std::min(next_late.value_or(allowed - elapsed), allowed - elapsed);
          break;
        }
        auto ji = jobs_.find(rec.job);
        if (ji == jobs_.end()) continue;
        auto* x = ji->second->pieces.find(rec.id);
        if (!x || x->holders.size() != 1 || x->holders[0] == p) continue;
        best_job = ji->second.get();
        best_id = rec.id;
        most_late = elapsed / allowed;
      }
    }
    if (!best_job) {
      // Nothing is late yet: look again when the first chunk would be.
      if (next_late) {
        auto at = now + std::chrono::duration_cast<clock_type::duration>(
                            std::chrono::duration<double, std::nano>(*next_late));
        if (!speculation_check_ || *speculation_check_ <= now || at < *speculation_check_) {
          speculation_check_ = at;
          wake_at(at);
        }
      }
      return false;
    }
    auto n = best_job->pieces.find(best_id)->items.size();
    {
      std::lock_guard<std::mutex> guard{stats_->mtx};
      stats_->value.duplicated_items += n;
    }
    send(p, *best_job, best_id);
    return true;
  }

  bool dispatch_from(job_state& j, std::size_t p, clock_type::time_point now) {
    if (auto id = j.pieces.take_queued(p, now, only_choice(p))) {
      send(p, j, *id);
      return true;
    }
    auto& s = producers_[p];
    piece x;
    try {
      x.items = j.source->pull(chunk_limit(s), opts_.max_chunk_bytes, opts_.target_chunk_time);
    } catch (...) {
      j.exhausted = true;
      end_job(j.id, std::current_exception());
      return true;  // the job is gone; look again
    }
    j.exhausted = j.source->exhausted();
    if (x.items.empty()) {
      touch(j);
      return j.exhausted;  // looked again with the job now exhausted
    }
    x.first = j.next_item;
    j.next_item += x.items.size();
    j.report.items = j.next_item;
    send(p, j, j.pieces.add(std::move(x)));
    return true;
  }

  void send(std::size_t p, job_state& j, std::uint64_t id) {
    auto& s = producers_[p];
    auto& x = *j.pieces.find(id);
    // A caller's range is lent to local producers only: a node gets a copy (its message is
    // written later, on the network's thread).
    if (!s.local && x.items.lease()) x.items = x.items.owned();
    x.holders.push_back(p);
    sent_chunk rec;
    rec.job = j.id;
    rec.id = id;
    rec.items = x.items.size();
    rec.sent = clock_now();
    rec.behind = s.outstanding.size();
    rec.bytes = x.items.get() ? x.items.get()->flat_bytes().value_or(opts_.max_chunk_bytes) : 0;
    s.outstanding.push_back(rec);
    s.items += rec.items;
    auto cost =
        static_cast<double>(rec.items) * (s.ns_per_item > 0 ? s.ns_per_item : unknown_ns_per_item);
    share_.charge(j.id, cost, static_cast<double>(j.opts.weight));
    touch(j);
    auto gen = s.gen;
    auto job = j.id;
    // A large chunk for a remote producer travels as fragments, then a small reference.
    work_chunk msg{job, x.first, bulk::split_for(self_, s.handle, x.items),
                   !j.opts.on_error.fails_fast()};
    self_->request(s.handle, caf::infinite, std::move(msg))
        .then([this, p, gen, id, job](chunk_result& r) { on_result(p, gen, job, id, r); },
              [this, p, gen](caf::error& err) {
                if (producers_[p].gen == gen && !producers_[p].restarting) give_up(p, err);
              });
  }

  /// Wakes this actor at `t` (a retry's backoff ends, a chunk becomes late). A time already
  /// passed wakes it at once: the caller computed `t` from a clock read earlier in this event,
  /// and a wakeup dropped because the thread was preempted in between would leave the job
  /// waiting for an event that never comes (it hung CI once: an ordered job whose only way on
  /// was a speculative copy).
  void wake_at(clock_type::time_point t) {
    if (auto hook = fault_points::before_wake.load()) hook();
    auto now = clock_now();
    if (t <= now) {
      self_->send(self_, wakeup_atom::value);
      return;
    }
    self_->delayed_send(self_,
                        std::chrono::duration_cast<std::chrono::microseconds>(t - now) +
                            std::chrono::microseconds{100},
                        wakeup_atom::value);
  }

  // -- results -----------------------------------------------------------------------------

  void on_result(std::size_t p, std::uint64_t gen, std::uint64_t job, std::uint64_t id,
                 chunk_result& r) {
    // Joined first, even for an answer dropped below, so that its fragments are released.
    try {
      r.outputs = bulk::resolve(r.outputs);
    } catch (const std::exception& e) {
      r.outputs = {};
      if (r.ok()) {
        r.code = errc::protocol_error;
        r.what = e.what();
      }
    }
    auto& s = producers_[p];
    // An answer from a handle given up on (the chunk went elsewhere): dropped, so that every
    // output is delivered exactly once.
    if (s.gen != gen) return;
    auto now = clock_now();
    auto rec = std::find_if(s.outstanding.begin(), s.outstanding.end(),
                            [&](const sent_chunk& x) { return x.job == job && x.id == id; });
    if (rec != s.outstanding.end()) {
      s.learn(*rec, r.busy_ns, r.idle_ns, r.ok(), settings_);
      s.items -= rec->items;
      s.outstanding.erase(rec);
    }
    s.last_done = now;
    s.restarts_in_row = 0;
    {
      std::lock_guard<std::mutex> guard{stats_->mtx};
      stats_->value.producers[p].busy += std::chrono::nanoseconds{r.busy_ns};
    }
    if (closing_) return;
    auto ji = jobs_.find(job);
    std::optional<piece> x;
    if (ji != jobs_.end()) x = ji->second->pieces.take_out(id);
    // Quarantine counts every throw of this producer, also for a job that has ended.
    bool quarantine = count_failures(s, r, x ? x->items.size() : 0, x ? x->first : 0);
    if (x) {
      auto& j = *ji->second;
      if (!r.ok()) {
        if (r.code == errc::work_error)
          end_job(job,
                  std::make_exception_ptr(work_error(
                      "producer::work threw on item " + std::to_string(r.failed_index) + " on " +
                          s.where.str() + " (producer " + std::to_string(p) + "): " + r.what,
                      r.failed_index, s.where.str())));
        else
          end_job(job, std::make_exception_ptr(protocol_error(r.what)));
      } else {
        {
          std::lock_guard<std::mutex> guard{stats_->mtx};
          stats_->value.producers[p].items += r.outputs.size();
        }
        if (r.failures.empty())
          deliver(j, x->first, x->items.size(), std::move(r.outputs));
        else
          handle_failures(j, p, std::move(*x), r);
        if (auto again = jobs_.find(job); again != jobs_.end()) touch(*again->second);
      }
    }
    if (!x && ji != jobs_.end() && r.ok() && r.failures.empty() &&
        fault_points::planted.load() == fault_points::planted_bug::deliver_late_answer)
      deliver(*ji->second, r.first, r.outputs.size(), std::move(r.outputs));
    if (quarantine) quarantine_producer(p);
    pump();
  }

  /// Counts the items that threw in a row on `s`; true when it reaches quarantine_after.
  bool count_failures(producer_slot& s, const chunk_result& r, std::size_t n, std::uint64_t first) {
    if (!r.ok() && r.code != errc::work_error) return false;
    if (r.ok() && r.failures.empty()) {
      s.failures_in_row = 0;
      return false;
    }
    bool reached = false;
    auto bump = [&] {
      ++s.failures_in_row;
      reached = reached || (opts_.quarantine_after && s.failures_in_row >= opts_.quarantine_after);
    };
    if (!r.ok()) {  // stopped at its first throw
      if (r.failed_index != first) s.failures_in_row = 0;
      bump();
      return reached;
    }
    auto expect = first;  // the item after the previous failure
    for (auto& f : r.failures) {
      if (f.index != expect) s.failures_in_row = 0;
      bump();
      expect = f.index + 1;
    }
    if (n > 0 && expect != first + n) s.failures_in_row = 0;
    return reached;
  }

  /// Items of piece `x` threw (a job with skip or retry): each is retried, skipped or ends the
  /// job; the outputs of the others are delivered around them.
  void handle_failures(job_state& j, std::size_t p, piece x, chunk_result& r) {
    auto& pol = j.opts.on_error;
    auto& s = producers_[p];
    auto job = j.id;
    std::uint64_t seg = x.first;  // the first item of the current run of successes
    std::size_t out = 0;          // its first output
    auto flush = [&](std::uint64_t upto) {
      if (upto > seg) {
        auto n = static_cast<std::size_t>(upto - seg);
        deliver_part(j, seg, n, r.outputs, out);
        out += n;
      }
    };
    for (auto& f : r.failures) {
      if (f.index < x.first || f.index >= x.first + x.items.size()) {
        end_job(job, std::make_exception_ptr(protocol_error("a producer reported item " +
                                                            std::to_string(f.index) +
                                                            " outside the chunk it was sent")));
        return;
      }
      flush(f.index);
      seg = f.index + 1;
      auto attempts = x.attempt + 1;
      if (attempts <= pol.retries) {
        piece again;
        again.first = f.index;
        auto at = static_cast<std::size_t>(f.index - x.first);
        again.items = x.items.slice(at, at + 1);
        again.attempt = attempts;
        again.avoid = p;
        again.not_before = clock_now() + pol.backoff;
        if (pol.backoff.count() > 0) wake_at(again.not_before);
        again.last_error = f.what;
        again.last_where = s.where.str();
        if (fault_points::planted.load() != fault_points::planted_bug::drop_retry ||
            again.first % 7 != 3)
          j.pieces.add_queued(std::move(again));
        j.report.retries += 1;
        continue;
      }
      auto what = "producer::work threw on item " + std::to_string(f.index) + " on " +
                  s.where.str() + " (producer " + std::to_string(p) + ")" +
                  (attempts > 1 ? " at each of " + std::to_string(attempts) + " attempts" : "") +
                  ": " + f.what;
      if (!pol.skips) {
        end_job(job, std::make_exception_ptr(work_error(what, f.index, s.where.str())));
        return;
      }
      j.report.failures.push_back(item_failure{f.index, f.what, s.where.str(), attempts});
      if (j.report.failures.size() > pol.max_failures) {
        end_job(job, std::make_exception_ptr(work_error(
                         "more than " + std::to_string(pol.max_failures) +
                             " item(s) failed (error_policy max_failures); the last: " + what,
                         f.index, s.where.str())));
        return;
      }
      if (j.ordered) j.reorder.add(f.index, 1, batch{});  // a gap the order passes over
    }
    flush(x.first + x.items.size());
    if (j.ordered) release(j);
  }

  /// Outputs [out, out + n) of `outputs` are items [first, first + n) of `j`.
  void deliver_part(job_state& j, std::uint64_t first, std::size_t n, const batch& outputs,
                    std::size_t out) {
    if (!j.ordered) {
      if (out == 0 && n == outputs.size())
        send_to_consumer(j, outputs);
      else
        send_to_consumer(j, outputs.slice(out, out + n));
      return;
    }
    j.reorder.add(first, n, outputs.slice(out, out + n));
  }

  /// A piece's outputs, all of its items.
  void deliver(job_state& j, std::uint64_t first, std::size_t n, batch outputs) {
    if (!j.ordered) {
      send_to_consumer(j, std::move(outputs));
      return;
    }
    j.reorder.add(first, n, std::move(outputs));
    release(j);
  }

  void release(job_state& j) {
    j.reorder.release([&](batch b) { send_to_consumer(j, std::move(b)); });
  }

  /// Tells options::on_event (on this thread; what it throws is ignored).
  void emit(producer_event::kind kind, std::size_t p, std::string reason) {
    if (!opts_.on_event) return;
    mark_internal_thread();  // a close() or run() from the handler must not wait for itself
    producer_event e;
    e.what = kind;
    e.producer = p;
    e.where = producers_[p].where;
    e.reason = std::move(reason);
    try {
      opts_.on_event(e);
    } catch (...) {
      log(log_level::warn, "on_event threw; ignored");
    }
  }

  /// A producer is lost (its actor or node died) or stuck (work_timeout): its chunks go to the
  /// others, its late answers are dropped, and a local one is replaced by a fresh one.
  void give_up(std::size_t p, const caf::error& err, bool quarantine = false,
               producer_event::kind kind = producer_event::kind::lost) {
    auto& s = producers_[p];
    if (!s.alive) return;
    if (quarantine) kind = producer_event::kind::quarantined;
    s.alive = false;
    s.gen += 1;
    s.quarantined = quarantine;
    bool replace = s.local && !closing_ && !quarantine && s.restarts_in_row < max_restarts_in_row;
    if (quarantine)
      log(log_level::warn, "producer " + std::to_string(p) + " on " + s.where.str() +
                               " is quarantined: its work() threw " +
                               std::to_string(s.failures_in_row) +
                               " times in a row (options::quarantine_after); its work goes to "
                               "the others");
    else
      log(log_level::warn, "producer " + std::to_string(p) + " on " + s.where.str() + " is " +
                               (err == caf::exit_reason::unreachable ? "unreachable" : "lost") +
                               " (" + error_text(err) + "); its work goes to the others" +
                               (replace ? ", and a fresh producer replaces it" : ""));
    {
      std::lock_guard<std::mutex> guard{stats_->mtx};
      stats_->value.producers[p].alive = false;
      stats_->value.producers[p].quarantined = quarantine;
    }
    emit(kind, p,
         quarantine ? "work() threw " + std::to_string(s.failures_in_row) +
                          " times in a row (options::quarantine_after)"
                    : error_text(err));
    for (auto& rec : s.outstanding) {
      auto ji = jobs_.find(rec.job);
      if (ji == jobs_.end()) continue;
      if (ji->second->pieces.drop_holder(rec.id, p)) ji->second->report.redispatched += rec.items;
      touch(*ji->second);
    }
    s.outstanding.clear();
    s.items = 0;
    if (s.local || quarantine) self_->send_exit(s.handle, caf::exit_reason::user_shutdown);
    if (replace) restart(p);
    check_survivors();
    pump();
  }

  void quarantine_producer(std::size_t p) {
    give_up(p, make_error(errc::work_error, "quarantined"), true);
  }

  /// Starts a fresh producer on the device of slot `p`; it takes work once constructed.
  void restart(std::size_t p) {
    auto& s = producers_[p];
    caf::actor fresh;
    try {
      fresh = spawn_(self_->system(), s.where, cfg_, p);
    } catch (const std::exception& e) {
      log(log_level::error, "cannot replace the producer on " + s.where.str() + ": " + e.what());
      return;
    }
    s.restarting = true;
    s.restarts_in_row += 1;
    s.handle = fresh;
    s.gen += 1;
    self_->monitor(fresh);
    auto gen = s.gen;
    self_->request(fresh, caf::infinite, init_atom::value)
        .then(
            [this, p, gen](const init_done&) {
              auto& s = producers_[p];
              if (s.gen != gen) return;
              s.restarting = false;
              if (closing_) {
                self_->send_exit(s.handle, caf::exit_reason::user_shutdown);
                return;
              }
              s.alive = true;
              s.outstanding.clear();
              s.items = 0;
              {
                std::lock_guard<std::mutex> guard{stats_->mtx};
                auto& ps = stats_->value.producers[p];
                ps.alive = true;
                ps.restarts += 1;
              }
              log(log_level::info, "producer " + std::to_string(p) + " on " + s.where.str() +
                                       " was replaced by a fresh one");
              emit(producer_event::kind::replaced, p, "a fresh producer on the same device");
              pump();
            },
            [this, p, gen](const caf::error& err) {
              auto& s = producers_[p];
              if (s.gen != gen) return;
              s.restarting = false;
              log(log_level::error, "the replacement producer on " + s.where.str() +
                                        " failed to start: " + error_text(err));
              check_survivors();
              pump();
            });
  }

  /// Fails every job with node_error when no producer is left to take work.
  void check_survivors() {
    if (jobs_.empty()) return;
    if (std::any_of(producers_.begin(), producers_.end(),
                    [](auto& s) { return s.alive || s.restarting; }))
      return;
    std::string what = "every producer is lost (";
    bool all_local = true;
    bool any_quarantined = false;
    for (std::size_t i = 0; i < producers_.size(); ++i) {
      what += (i ? ", " : "") + producers_[i].where.str() +
              (producers_[i].quarantined ? ": quarantined" : "");
      all_local = all_local && producers_[i].local;
      any_quarantined = any_quarantined || producers_[i].quarantined;
    }
    what += "); the job's remaining work could not be done: ";
    what += any_quarantined ? "quarantined producers threw options::quarantine_after times in a "
                              "row; create a new runner"
            : all_local     ? "their replacements were stuck too or failed to start (see the "
                              "log); create a new runner"
                            : "create a new runner, with reachable nodes";
    while (!jobs_.empty()) end_job(jobs_.begin()->first, std::make_exception_ptr(node_error(what)));
  }

  // -- consumer ------------------------------------------------------------------------------

  /// Outputs for the consumer: sent at the end of this event (flush_consumer), at most
  /// options::consumer_backlog chunks unacknowledged; the rest wait here.
  void send_to_consumer(job_state& j, batch outputs) { j.pending.push_back(std::move(outputs)); }

  /// Whether every output of `j` is through the producers and the reorder window.
  static bool all_through(const job_state& j) {
    return j.exhausted && j.pieces.empty() && j.reorder.empty();
  }

  void flush_consumer(job_state& j) {
    while (!j.pending.empty() && j.backlog < opts_.consumer_backlog) {
      auto outputs = std::move(j.pending.front());
      j.pending.pop_front();
      // The job's final outputs carry consumer::end() with them (no end_of_input round trip).
      bool last = j.pending.empty() && all_through(j) && !j.ending;
      auto n = outputs.size();
      j.sent_to_consumer += n;
      if (last) {
        j.ending = true;
        conclude(j);
      }
      auto job = j.id;
      j.backlog += 1;
      self_->request(j.consumer, caf::infinite, consume_chunk{job, std::move(outputs), last})
          .then(
              [this, job, n, last](const consume_ack&) {
                auto ji = jobs_.find(job);
                if (ji == jobs_.end()) return;
                auto& j = *ji->second;
                j.backlog -= 1;
                j.consumed += n;
                if (!j.concluded) {
                  std::lock_guard<std::mutex> guard{stats_->mtx};
                  stats_->value.items += n;
                }
                if (last) {
                  end_job(job, nullptr);
                } else {
                  report_progress(j, false);
                  touch(j);
                }
                pump();
              },
              [this, job](caf::error& err) {
                if (!jobs_.count(job)) return;
                end_job(job, std::make_exception_ptr(consumer_error(error_text(err))));
                pump();
              });
    }
  }

  /// The job's last outputs go to its consumer with consumer::end(): what get() shows once it
  /// returns (report, progress, stats) is made final now, so that the consumer can finish the
  /// job itself, without a round trip through this actor. Undone (counted as failed) when end()
  /// throws.
  void conclude(job_state& j) {
    j.concluded = true;
    {
      std::lock_guard<std::mutex> guard{stats_->mtx};
      stats_->value.items += j.sent_to_consumer - j.consumed;
      stats_->value.runs += 1;
    }
    auto consumed = j.consumed;
    j.consumed = j.sent_to_consumer;
    report_progress(j, true);
    j.consumed = consumed;
    publish_report(j);
  }

  void publish_report(job_state& j) {
    std::sort(j.report.failures.begin(), j.report.failures.end(),
              [](const item_failure& a, const item_failure& b) { return a.index < b.index; });
    j.core->update_report([&](job_report& r) { r = j.report; });
  }

  void report_progress(job_state& j, bool final) {
    auto now = clock_now();
    if (!final && now - j.last_progress < std::chrono::milliseconds{100}) return;
    j.last_progress = now;
    progress p;
    p.done = j.consumed;
    p.total = j.source ? j.source->total() : std::nullopt;
    p.elapsed_seconds = std::chrono::duration<double>(now - j.started).count();
    p.items_per_second =
        p.elapsed_seconds > 0 ? static_cast<double>(j.consumed) / p.elapsed_seconds : 0;
    j.core->set_progress(p);
    j.core->update_report([&](job_report& r) {
      r.items = j.report.items;
      r.retries = j.report.retries;
      r.redispatched = j.report.redispatched;
    });
    for (auto* f : {&j.opts.on_progress, &opts_.on_progress}) {
      if (!*f) continue;
      try {
        (*f)(p);
      } catch (...) {
        log(log_level::warn, "on_progress threw; ignored");
      }
    }
  }

  // -- the end of a job ----------------------------------------------------------------------

  void maybe_finish(std::uint64_t id) {
    auto ji = jobs_.find(id);
    if (ji == jobs_.end()) return;
    auto& j = *ji->second;
    if (j.ending || !all_through(j) || !j.pending.empty() || j.backlog > 0) return;
    j.ending = true;
    self_->request(j.consumer, caf::infinite, end_of_input{id})
        .then(
            [this, id](const consume_ack&) {
              end_job(id, nullptr);
              pump();
            },
            [this, id](caf::error& err) {
              end_job(id, std::make_exception_ptr(consumer_error(error_text(err))));
              pump();
            });
  }

  /// Ends job `id` (e: nullptr on success): its state is dropped, answers still on their way
  /// are dropped when they come, and its handle wakes up. Its consumer is disposed of by the
  /// thread that waits for the job, before get() returns.
  void end_job(std::uint64_t id, std::exception_ptr e) {
    auto ji = jobs_.find(id);
    if (ji == jobs_.end()) return;
    auto j = std::move(ji->second);
    jobs_.erase(ji);
    share_.leave(id);
    // A consumer that concluded the job has finished it already: that outcome stands.
    if (j->core->done()) e = j->core->error();
    if (e) j->gate->stop();  // its consumer gives up the chunk it may be working on
    if (!e && !j->concluded) report_progress(*j, true);
    j->source.reset();  // the caller's range must not be touched once the job has ended
    {
      std::lock_guard<std::mutex> guard{stats_->mtx};
      if (!j->concluded) stats_->value.runs += 1;
      if (e) stats_->value.failed_runs += 1;
    }
    if (!j->concluded || e) publish_report(*j);
    j->core->finish(std::move(e));
  }

  void ended_one() {
    if (pending_ends_ > 0 && --pending_ends_ == 0) finish_close();
  }

  void finish_close() {
    if (!close_promise_) return;
    while (!jobs_.empty())  // a consumer::end() that has not answered by now
      end_job(jobs_.begin()->first,
              std::make_exception_ptr(runner_closed("the runner was closed during this job")));
    for (auto& s : producers_)
      if (s.handle) self_->send_exit(s.handle, caf::exit_reason::user_shutdown);
    auto done = std::move(close_promise_);
    close_promise_ = nullptr;
    done->set_value();
    self_->quit();
  }

  caf::event_based_actor* self_;
  options opts_;
  model_settings settings_;  ///< what producer_model reads of opts_
  std::shared_ptr<stats_box> stats_;
  producer_spawner spawn_;
  config cfg_;
  std::vector<producer_slot> producers_;
  bool closing_ = false;
  std::size_t pending_ends_ = 0;
  std::shared_ptr<std::promise<void>> close_promise_;
  std::map<std::uint64_t, std::unique_ptr<job_state>> jobs_;  ///< running, oldest first
  /// So that an event costs the same with 10 or 10,000 jobs running: the jobs by fair-share
  /// pass (those that may have work for a producer apart), and the jobs this event changed.
  fair_share share_;
  std::vector<std::uint64_t> touched_;
  std::optional<clock_type::time_point> speculation_check_;  ///< a wakeup to look for late chunks
};

}  // namespace

caf::actor spawn_scheduler(caf::actor_system& sys, std::vector<caf::actor> producers,
                           std::vector<device> devices, options opts,
                           std::shared_ptr<stats_box> stats, producer_spawner spawn, config cfg,
                           bool detached) {
  // The state travels as a spawn argument: a spawn without arguments makes CAF 0.17.6
  // dereference a null std::shared_ptr<std::tuple<>> (UBSan reports it).
  auto init = [producers = std::move(producers), devices = std::move(devices),
               opts = std::move(opts), spawn = std::move(spawn),
               cfg = std::move(cfg)](caf::event_based_actor* self,
                                     std::shared_ptr<stats_box> box) mutable -> caf::behavior {
    auto st =
        std::make_shared<scheduler>(self, std::move(producers), std::move(devices), std::move(opts),
                                    std::move(box), std::move(spawn), std::move(cfg));
    return {
        [st](std::shared_ptr<job_spec>& spec) {
          mark_internal_thread();
          st->start(std::move(spec));
        },
        [st](cancel_atom, std::uint64_t id) {
          mark_internal_thread();
          st->cancel(id);
          return consume_ack{id};
        },
        [st](deadline_atom, std::uint64_t id) { st->deadline_passed(id); },
        [st](wakeup_atom) { st->wakeup(); },
        [st](stall_check_atom) { st->check_stalls(); },
        [st](close_atom, std::shared_ptr<std::promise<void>>& done, bool timed) {
          mark_internal_thread();
          st->close(std::move(done), timed);
        },
        [st](close_timeout_atom) { st->close_timed_out(); },
        [](const bulk::fragment&) {},  // joined while it was deserialized
    };
  };
  if (!detached) return sys.spawn(std::move(init), std::move(stats));
  return sys.spawn<caf::detached>(std::move(init), std::move(stats));
}

}  // namespace troupe::detail
