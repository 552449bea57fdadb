// The scheduler (scheduler.hpp): jobs arriving, cancel, timers (deadlines, stalls), and close.
#include "scheduler.hpp"

namespace troupe::detail {

scheduler::scheduler(scheduler_io& io, std::vector<device> devices, options opts,
                     std::shared_ptr<stats_box> stats)
    : io_(io), opts_(std::move(opts)), settings_(settings_of(opts_)), stats_(std::move(stats)) {
  for (auto& d : devices) {
    producers_.push_back(make_slot(producers_.size(), d));
    count_remote(producers_.back(), slot_state::retired);
    room_changed(producers_.size() - 1);
  }
  if (!opts_.trace_file.empty()) {
    try {
      trace_ = std::make_unique<trace_writer>(opts_.trace_file, opts_.trace_max_bytes, io_.now());
      for (std::size_t p = 0; p < producers_.size(); ++p) trace_lane(p);
    } catch (const std::exception& e) {  // checked by the runner before: it was writable then
      log(log_level::error, std::string{"no trace: "} + e.what());
    }
  }
  // milliseconds::max() (or anything as long) is "never", like 0.
  if (opts_.work_timeout.count() > 0 && finite_wait(opts_.work_timeout)) schedule_stall_check();
}

void scheduler::start(std::shared_ptr<job_core> core, std::shared_ptr<input_source> source,
                      bool ordered, job_options opts, bool fold) {
  if (closing_) {
    stats_->queued -= source->total().value_or(0);  // counted by submit()
    io_.forget_job(core->id());
    core->finish(
        std::make_exception_ptr(runner_closed("the runner was closed before this job started")));
    return;
  }
  auto j = std::make_unique<job_state>();
  j->id = core->id();
  j->core = std::move(core);
  j->source = std::move(source);
  j->queued_left = j->source->total().value_or(0);  // counted by submit()
  j->ordered = ordered;
  j->opts = std::move(opts);
  j->fold = fold && j->opts.on_error.fails_fast();
  j->started = clock_now();  // last_progress: never, so the first ack reports at once
  j->gate = j->core->gate();
  auto id = j->id;
  if (j->opts.deadline.count() > 0 && finite_wait(j->opts.deadline))
    io_.set_timer(j->opts.deadline, scheduler_io::timer::deadline, id);
  // The consumer's constructor runs with its first message (a throw: that message's error).
  share_.join(id);
  auto& job = *jobs_.emplace(id, std::move(j)).first->second;
  trace_instant(trace_writer::scheduler_lane, "job " + std::to_string(id) + " submitted", "");
  touch(job);
  for (auto& s : producers_) s.restarts_in_row = 0;  // at most max_restarts_in_row per job
  check_survivors();
  pump();
}

void scheduler::cancel(std::uint64_t id) {
  auto i = jobs_.find(id);
  if (i == jobs_.end() || !i->second->gate->stop()) return;
  end_job(id, std::make_exception_ptr(
                  cancelled("job " + std::to_string(id) + " was cancelled (job_handle::cancel)")));
  pump();
}

void scheduler::timer_fired(scheduler_io::timer t, std::uint64_t id) {
  switch (t) {
    case scheduler_io::timer::deadline:
      deadline_passed(id);
      return;
    case scheduler_io::timer::wakeup:
      pump();
      return;
    case scheduler_io::timer::stall_check:
      check_stalls();
      return;
    case scheduler_io::timer::close_timeout:
      close_timed_out();
      return;
    case scheduler_io::timer::consumer_read:
      read_consumers();
      return;
    case scheduler_io::timer::drain_end:
      for (std::size_t p = 0; p < producers_.size(); ++p) {
        auto& s = producers_[p];
        if (s.state == slot_state::ending && s.end_gen == id && !closing_) {
          log(log_level::warn, "producer " + std::to_string(p) + " on " + s.where.str() +
                                   " did not finish producer::end() within "
                                   "options::close_timeout; left behind");
          retire(p, "producer::end() did not finish within options::close_timeout");
        }
      }
      return;
  }
}

producer_slot scheduler::make_slot(std::size_t p, const device& d) const {
  producer_slot s;
  s.where = d;
  s.local = d.is_local();
  s.cuts = opts_.split_late_chunks && io_.cuts_reach(p, d);
  if (opts_.chunk_size) s.chunk_items = opts_.chunk_size;
  return s;
}

void scheduler::add_producers(const std::vector<device>& devices) {
  for (auto& d : devices) {
    producers_.push_back(make_slot(producers_.size(), d));
    count_remote(producers_.back(), slot_state::retired);
    room_changed(producers_.size() - 1);
    trace_lane(producers_.size() - 1);
    trace_instant(producers_.size() - 1, "added", "add_devices");
    emit(producer_event::kind::added, producers_.size() - 1, "add_devices");
  }
  if (closing_) return;  // close() stops them with the others (finish_close)
  // Ordered jobs may have been held by a reorder window that is now larger.
  for (auto& [id, j] : jobs_) touch(*j);
  pump();
}

void scheduler::drain(const std::vector<std::size_t>& slots,
                      std::shared_ptr<std::promise<void>> done) {
  if (closing_) {
    done->set_value();
    return;
  }
  drain_wait w;
  w.done = std::move(done);
  for (auto p : slots)
    if (p < producers_.size() && producers_[p].state != slot_state::retired) w.left.insert(p);
  if (w.left.empty()) {
    w.done->set_value();
    return;
  }
  auto asked = w.left;
  drains_.push_back(std::move(w));
  for (auto p : asked) {
    switch (move(p, slot_event::drain)) {
      case slot_state::working:  // now draining
        room_changed(p);
        maybe_end_drained(p);
        break;
      case slot_state::restarting:  // its replacement (maybe still constructing) is stopped
        retire(p, "removed while a replacement was starting");
        break;
      case slot_state::lost:
      case slot_state::quarantined:  // nothing to end, nothing held (a loss re-queued it)
        retire(p, "lost while it drained");
        break;
      default:  // already leaving
        break;
    }
  }
  check_survivors();
  pump();
}

void scheduler::maybe_end_drained(std::size_t p) {
  auto& s = producers_[p];
  if (s.state != slot_state::draining || !s.outstanding.empty() || closing_) return;
  move(p, slot_event::end);
  s.end_gen = ++end_requests_;  // unique: a timer left from another slot's drain never matches
  io_.end_producer(p);
  if (finite_wait(opts_.close_timeout))
    io_.set_timer(opts_.close_timeout, scheduler_io::timer::drain_end, s.end_gen);
}

void scheduler::retire(std::size_t p, const std::string& why) {
  auto& s = producers_[p];
  if (s.state == slot_state::retired) return;
  bool was_ending = end_pending(move(p, slot_event::retire));
  room_changed(p);
  s.gen += 1;              // answers still on their way are dropped
  requeue_outstanding(p);  // none after a drain; a loss re-queued them already
  s.release();
  {
    std::lock_guard<std::mutex> guard{stats_->mtx};
    stats_->value.producers[p].alive = false;
    stats_->value.producers[p].removed = true;
  }
  stats_->presence.fetch_add(1, std::memory_order_release);
  io_.stop_producer(p);
  trace_instant(p, "removed", why);
  emit(producer_event::kind::removed, p, why);
  if (was_ending && closing_) ended_one();
  check_survivors();  // jobs held for a draining producer's chunks may have no one left now
  for (auto i = drains_.begin(); i != drains_.end();) {
    i->left.erase(p);
    if (i->left.empty()) {
      i->done->set_value();
      i = drains_.erase(i);
    } else {
      ++i;
    }
  }
}

void scheduler::deadline_passed(std::uint64_t id) {
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

void scheduler::check_stalls() {
  if (closing_) return;
  auto now = clock_now();
  for (std::size_t p = 0; p < producers_.size(); ++p) {
    auto& s = producers_[p];
    if (!alive(s.state) || s.outstanding.empty()) continue;
    // A producer works FIFO: its oldest chunk started when it was sent or when the chunk
    // ahead of it was answered, whichever came later. Time spent queued does not count.
    auto began = std::max(s.outstanding.front().sent, s.last_done);
    if (now - began >= opts_.work_timeout)
      give_up(p,
              "busy with one chunk for more than " + std::to_string(opts_.work_timeout.count()) +
                  " ms (options::work_timeout)",
              false, false, producer_event::kind::timed_out);
  }
  schedule_stall_check();
}

void scheduler::close(std::shared_ptr<std::promise<void>> done, bool timed) {
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
  for (std::size_t p = 0; p < producers_.size(); ++p) {
    auto& s = producers_[p];
    if (s.state == slot_state::retired) continue;
    if (end_pending(s.state)) {  // a drain's producer::end() is under way: waited for too
      ++pending_ends_;
      continue;
    }
    if (!alive(s.state)) {  // stuck, lost or still starting: not waited on
      io_.stop_producer(p);
      continue;
    }
    ++pending_ends_;
    move(p, slot_event::end);
    io_.end_producer(p);
  }
  if (pending_ends_ == 0)
    finish_close();
  else if (timed && finite_wait(opts_.close_timeout))
    io_.set_timer(opts_.close_timeout, scheduler_io::timer::close_timeout, 0);
}

void scheduler::producer_ended(std::size_t p, const std::string& why) {
  auto& s = producers_[p];
  if (!end_pending(s.state)) return;  // retired meanwhile (lost, or end() past its time)
  move(p, slot_event::ended);
  if (!why.empty())
    log(log_level::warn, "ending the producer on " + s.where.str() + " failed: " + why);
  if (closing_) {
    ended_one();
    return;
  }
  retire(p, why.empty() ? "drained: producer::end() has run" : "drained; producer::end(): " + why);
}

void scheduler::close_timed_out() {
  if (!close_promise_) return;
  log(log_level::warn, std::to_string(pending_ends_) +
                           " producer(s) did not finish within options::close_timeout; left "
                           "behind (their threads end when work() returns)");
  finish_close();
}

void scheduler::schedule_stall_check() {
  auto period = std::clamp<std::chrono::milliseconds>(
      opts_.work_timeout / 4, std::chrono::milliseconds{10}, std::chrono::milliseconds{1000});
  io_.set_timer(period, scheduler_io::timer::stall_check, 0);
}

}  // namespace troupe::detail
