// The scheduler (scheduler.hpp): a job's consumer (outputs within consumer_backlog), its
// progress and report, and its end; the end of close().
#include "scheduler.hpp"

namespace troupe::detail {

bool scheduler::all_through(const job_state& j) {
  return j.exhausted && j.pieces.empty() && j.reorder.empty();
}

void scheduler::flush_consumer(job_state& j) {
  while (!j.pending.empty()) {
    if (j.backlog() >= opts_.consumer_backlog &&
        !(read_consumer(j) && j.backlog() < opts_.consumer_backlog))
      break;
    auto outputs = std::move(j.pending.front());
    j.pending.pop_front();
    // The job's final outputs carry consumer::end() with them (no end_of_input round trip).
    bool last = j.pending.empty() && all_through(j) && !j.ending;
    auto n = outputs.size();
    j.sent_to_consumer += n;
    if (last) {
      j.ending = true;
      j.last_sent = true;
      conclude(j);
    }
    j.chunks_to_consumer += 1;
    io_.consume(consume_chunk{j.id, std::move(outputs), last}, n);
    if (!last) read_consumers_later();
  }
  // The job waits for its consumer (at its backlog's limit, or with nothing left but to end
  // once the consumer has taken what it has): the consumer acknowledges its next chunk with a
  // message. Told after it, the gate is read again (the consumer may have taken one in between
  // without seeing the wish), and the job looked at once more if it had.
  bool waits = j.backlog() >= opts_.consumer_backlog ||
               (j.backlog() > 0 && !j.ending && j.pending.empty() && all_through(j));
  if (waits == j.ack_wanted) return;
  j.ack_wanted = waits;
  j.gate->want_ack(waits);
  if (waits && read_consumer(j)) touch(j);
}

bool scheduler::read_consumer(job_state& j) {
  auto chunks = j.gate->chunks_done();
  if (chunks == j.chunks_read) return false;
  auto n = j.gate->delivered() - j.consumed;
  j.chunks_read = chunks;
  j.consumed += n;
  if (!j.concluded) {
    std::lock_guard<std::mutex> guard{stats_->mtx};
    stats_->value.items += n;
  }
  return true;
}

void scheduler::read_consumers() {
  read_timer_ = false;
  bool unread = false;
  for (auto& [id, j] : jobs_) {
    if (j->backlog() == 0 || j->ending) continue;
    if (read_consumer(*j)) {
      report_progress(*j, false);
      touch(*j);
    }
    unread = unread || j->backlog() > 0;
  }
  if (unread) read_consumers_later();
  pump();
}

void scheduler::read_consumers_later() {
  if (read_timer_) return;
  read_timer_ = true;
  io_.set_timer(consumer_read_period, scheduler_io::timer::consumer_read, 0);
}

void scheduler::consumer_acked(std::uint64_t job) {
  auto ji = jobs_.find(job);
  if (ji == jobs_.end()) return;
  auto& j = *ji->second;
  read_consumer(j);
  if (j.last_sent && j.chunks_read == j.chunks_to_consumer) {
    end_job(job, nullptr);
  } else {
    report_progress(j, false);
    touch(j);
  }
  pump();
}

void scheduler::consumer_failed(std::uint64_t job, const std::string& why) {
  if (!jobs_.count(job)) return;
  end_job(job, std::make_exception_ptr(consumer_error(why)));
  pump();
}

void scheduler::conclude(job_state& j) {
  j.concluded = true;
  {
    std::lock_guard<std::mutex> guard{stats_->mtx};
    stats_->value.items += j.sent_to_consumer - j.consumed;
    stats_->value.runs += 1;
    stats_->job_seconds.observe(std::chrono::duration<double>(clock_now() - j.started).count());
  }
  auto consumed = j.consumed;
  j.consumed = j.sent_to_consumer;
  report_progress(j, true);
  j.consumed = consumed;
  publish_report(j);
}

void scheduler::publish_report(job_state& j) {
  std::sort(j.report.failures.begin(), j.report.failures.end(),
            [](const item_failure& a, const item_failure& b) { return a.index < b.index; });
  j.core->update_report([&](job_report& r) { r = j.report; });
}

void scheduler::report_progress(job_state& j, bool final) {
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
  mark_internal_thread();  // a wait from the callback must be refused, not wait for itself
  for (auto* f : {&j.opts.on_progress, &opts_.on_progress}) {
    if (!*f) continue;
    try {
      (*f)(p);
    } catch (...) {
      log(log_level::warn, "on_progress threw; ignored");
    }
  }
}

void scheduler::maybe_finish(std::uint64_t id) {
  auto ji = jobs_.find(id);
  if (ji == jobs_.end()) return;
  auto& j = *ji->second;
  if (j.ending || !all_through(j) || !j.pending.empty() || j.backlog() > 0) return;
  j.ending = true;
  io_.end_input(id);
}

void scheduler::input_ended(std::uint64_t job) {
  end_job(job, nullptr);
  pump();
}

void scheduler::end_job(std::uint64_t id, std::exception_ptr e) {
  auto ji = jobs_.find(id);
  if (ji == jobs_.end()) return;
  auto j = std::move(ji->second);
  jobs_.erase(ji);
  unqueue(*j, j->queued_left);
  share_.leave(id);
  io_.forget_job(id);
  for (auto& p : producers_) p.forget(id);  // its cost model: the next job starts small again
  // A consumer that concluded the job has finished it already: that outcome stands.
  if (j->core->done()) e = j->core->error();
  if (e) {
    j->gate->stop();  // its consumer gives up the chunk it may be working on
    // Its producers in this process stop at their next claim (options::split_late_chunks): the
    // items of its chunks not started yet are taken back, and the answers come early.
    if (any_cuts_)
      for (auto& s : producers_)
        for (auto& rec : s.outstanding)
          if (rec.job == id && rec.cut) rec.cut->trim(true);
  }
  trace_instant(trace_writer::scheduler_lane,
                "job " + std::to_string(id) + (e ? " failed" : " ended"), "");
  if (!e && !j->concluded) report_progress(*j, true);
  j->source.reset();  // the caller's range must not be touched once the job has ended
  {
    std::lock_guard<std::mutex> guard{stats_->mtx};
    if (!j->concluded) {
      stats_->value.runs += 1;
      stats_->job_seconds.observe(std::chrono::duration<double>(clock_now() - j->started).count());
    }
    if (e) stats_->value.failed_runs += 1;
  }
  if (!j->concluded || e) publish_report(*j);
  j->core->finish(std::move(e));
}

void scheduler::ended_one() {
  if (pending_ends_ > 0 && --pending_ends_ == 0) finish_close();
}

void scheduler::finish_close() {
  if (!close_promise_) return;
  while (!jobs_.empty())  // a consumer::end() that has not answered by now
    end_job(jobs_.begin()->first,
            std::make_exception_ptr(runner_closed("the runner was closed during this job")));
  for (std::size_t p = 0; p < producers_.size(); ++p) io_.stop_producer(p);
  for (auto& w : drains_) w.done->set_value();  // remove_devices callers: the runner closed
  drains_.clear();
  trace_.reset();  // complete before close() returns
  auto done = std::move(close_promise_);
  close_promise_ = nullptr;
  done->set_value();
  io_.quit();
}

}  // namespace troupe::detail
