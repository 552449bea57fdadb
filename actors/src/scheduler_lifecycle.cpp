// The scheduler (scheduler.hpp): jobs arriving, cancel, timers (deadlines, stalls), and close.
#include "scheduler.hpp"

namespace troupe::detail {

scheduler::scheduler(scheduler_io& io, std::vector<device> devices, options opts,
                     std::shared_ptr<stats_box> stats)
    : io_(io), opts_(std::move(opts)), settings_(settings_of(opts_)), stats_(std::move(stats)) {
  for (std::size_t i = 0; i < devices.size(); ++i) {
    producer_slot s;
    s.where = devices[i];
    s.local = devices[i].is_local();
    if (opts_.chunk_size) s.chunk_items = opts_.chunk_size;
    producers_.push_back(std::move(s));
  }
  // milliseconds::max() (or anything as long) is "never", like 0.
  if (opts_.work_timeout.count() > 0 && finite_wait(opts_.work_timeout)) schedule_stall_check();
}

void scheduler::start(std::shared_ptr<job_core> core, std::shared_ptr<input_source> source,
                      bool ordered, job_options opts, bool fold) {
  if (closing_) {
    io_.forget_job(core->id());
    core->finish(
        std::make_exception_ptr(runner_closed("the runner was closed before this job started")));
    return;
  }
  auto j = std::make_unique<job_state>();
  j->id = core->id();
  j->core = std::move(core);
  j->source = std::move(source);
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
    if (!s.alive || s.outstanding.empty()) continue;
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
    if (!producers_[p].alive) {  // stuck, lost or still starting: not waited on
      io_.stop_producer(p);
      continue;
    }
    ++pending_ends_;
    io_.end_producer(p);
  }
  if (pending_ends_ == 0)
    finish_close();
  else if (timed && finite_wait(opts_.close_timeout))
    io_.set_timer(opts_.close_timeout, scheduler_io::timer::close_timeout, 0);
}

void scheduler::producer_ended(std::size_t p, const std::string& why) {
  if (!why.empty())
    log(log_level::warn, "ending the producer on " + producers_[p].where.str() + " failed: " + why);
  ended_one();
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
