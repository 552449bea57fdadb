// The scheduler actor (scheduler.hpp): its messages, jobs arriving, cancel, deadlines, stalls
// and close.
#include "scheduler.hpp"

namespace troupe::detail {

std::atomic<void (*)()> fault_points::before_wake{nullptr};
std::atomic<fault_points::planted_bug> fault_points::planted{fault_points::planted_bug::none};

scheduler::scheduler(caf::event_based_actor* self, std::vector<caf::actor> producers,
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

void scheduler::start(std::shared_ptr<job_spec> spec) {
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

void scheduler::cancel(std::uint64_t id) {
  auto i = jobs_.find(id);
  if (i == jobs_.end() || !i->second->gate->stop()) return;
  end_job(id, std::make_exception_ptr(
                  cancelled("job " + std::to_string(id) + " was cancelled (job_handle::cancel)")));
  pump();
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
              make_error(errc::node_error, "busy with one chunk for more than " +
                                               std::to_string(opts_.work_timeout.count()) +
                                               " ms (options::work_timeout)"),
              false, producer_event::kind::timed_out);
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
  self_->delayed_send(self_, period, stall_check_atom::value);
}

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
