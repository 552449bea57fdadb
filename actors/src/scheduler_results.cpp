// The scheduler (scheduler.hpp): producers' answers, the jobs' error policies, and producer
// health (given up on, replaced, quarantined).
#include "scheduler.hpp"

namespace troupe::detail {

void scheduler::on_result(std::size_t p, std::uint64_t gen, std::uint64_t job, std::uint64_t id,
                          chunk_result& r) {
  auto& s = producers_[p];
  // At 8,000 producers an answer's slot, its piece, its outputs and the slot's records are each
  // a cache miss: asked for together, they overlap.
  prefetch_bytes(&s, sizeof(s));
  auto ji = jobs_.find(job);  // (nothing below ends a job before its answer is taken)
  if (ji != jobs_.end()) ji->second->pieces.prefetch(id);
  __builtin_prefetch(r.outputs.get());
  // An answer from a handle given up on (the chunk went elsewhere): dropped, so that every
  // output is delivered exactly once.
  if (s.gen != gen) {
    std::lock_guard<std::mutex> guard{stats_->mtx};
    stats_->value.late_answers += 1;
    return;
  }
  if (r.kept >= 0) {  // a node's chunk trimmed there: this answer may come before the trim's
    auto t = s.find(job, id);
    if (t != s.outstanding.end() && t->cut_id != 0) apply_trim(p, *t, r.kept);
  }
  __builtin_prefetch(s.outstanding.data());
  __builtin_prefetch(s.rates.data());
  auto now = clock_now();
  auto rec = s.find(job, id);
  if (rec != s.outstanding.end()) {
    if (trace_)
      trace_->chunk(p, flow_id(job, id), job, r.first, rec->items, rec->bytes,
                    std::chrono::nanoseconds{r.busy_ns}, std::chrono::nanoseconds{r.idle_ns},
                    rec->sent, now, r.ok());
    // Not from a job that has ended: its cost model is forgotten (and its chunks may have
    // been cut short at its end, which would read as fast items).
    if (rec->items > 0 && ji != jobs_.end()) s.learn(*rec, r.busy_ns, r.idle_ns, r.ok(), settings_);
    s.items -= rec->items;
    s.outstanding.erase(rec);
    room_changed(p);
  }
  s.last_done = now;
  s.restarts_in_row = 0;
  {
    std::lock_guard<std::mutex> guard{stats_->mtx};
    stats_->value.producers[p].busy += std::chrono::nanoseconds{r.busy_ns};
    stats_->value.split_calls += r.extra_calls;
    stats_->chunk_seconds.observe(static_cast<double>(r.busy_ns) * 1e-9);
    if (!s.local && r.outputs.get())
      if (auto flat = r.outputs.get()->flat_bytes()) stats_->node_bytes_received += *flat;
    if (r.ok() && !r.outputs.empty())
      stats_->last_item_unix_seconds =
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
              .count();
  }
  if (closing_) return;
  maybe_end_drained(p);  // a producer being removed: its last chunk is in
  std::optional<piece> x;
  if (ji != jobs_.end()) x = ji->second->pieces.take_out(id);
  // Quarantine counts every throw of this producer, also for a job that has ended.
  bool quarantine = count_failures(s, r, x ? x->items.size() : 0, x ? x->first : 0);
  if (x) {
    auto& j = *ji->second;
    if (!r.ok()) {
      if (r.code == errc::work_error)
        end_job(job, std::make_exception_ptr(work_error(
                         "producer::work threw on item " + std::to_string(r.failed_index) + " on " +
                             s.where.str() + " (producer " + std::to_string(p) + "): " + r.what,
                         r.failed_index, s.where.str())));
      else if (r.code == errc::cancelled)  // its handle took the caller's range back
        end_job(job, taken_back(job));
      else if (r.code == errc::consumer_error)  // a consumer folding the chunk on a producer
        end_job(job,
                std::make_exception_ptr(consumer_error(r.what + " (on " + s.where.str() +
                                                       ", producer " + std::to_string(p) + ")")));
      else
        end_job(job, std::make_exception_ptr(protocol_error(r.what)));
    } else if (auto bad = malformed(*x, r)) {
      end_job(job, std::make_exception_ptr(protocol_error(*bad)));
    } else {
      {
        std::lock_guard<std::mutex> guard{stats_->mtx};
        stats_->value.producers[p].items += r.outputs.size();
        stats_->value.producers[p].chunks += 1;
      }
      if (r.failures.empty())
        deliver(j, x->first, x->items.size(), std::move(r.outputs));
      else
        handle_failures(j, p, std::move(*x), r);
      if (auto again = jobs_.find(job); again != jobs_.end()) {
        auto& k = *again->second;
        if (read_consumer(k)) report_progress(k, false);  // what its consumer took meanwhile
        touch(k);
      }
    }
  }
  if (!x && ji != jobs_.end() && r.ok() && r.failures.empty() &&
      io_.planted() == planted_bug::deliver_late_answer)
    deliver(*ji->second, r.first, r.outputs.size(), std::move(r.outputs));
  if (quarantine) quarantine_producer(p);
  pump();
}

bool scheduler::count_failures(producer_slot& s, const chunk_result& r, std::size_t n,
                               std::uint64_t first) {
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

std::exception_ptr scheduler::taken_back(std::uint64_t job) {
  return std::make_exception_ptr(
      cancelled("job " + std::to_string(job) + " was cancelled (its handle was given up)"));
}

std::optional<std::string> scheduler::malformed(const piece& x, const chunk_result& r) {
  // A producer (a node's, possibly a faulty or hostile one) answers every item once: an output,
  // or a failure listed in input order within the chunk.
  auto n = x.items.size();
  auto expect = x.first;
  for (auto& f : r.failures) {
    if (f.index < expect || f.index >= x.first + n)
      return "a producer reported item " + std::to_string(f.index) +
             (f.index < x.first || f.index >= x.first + n ? " outside the chunk it was sent"
                                                          : " out of order or twice");
    expect = f.index + 1;
  }
  if (r.failures.size() + r.outputs.size() != n)
    return "a producer answered a chunk of " + std::to_string(n) + " item(s) with " +
           std::to_string(r.outputs.size()) + " output(s) and " +
           std::to_string(r.failures.size()) + " failure(s)";
  return std::nullopt;
}

void scheduler::handle_failures(job_state& j, std::size_t p, piece x, chunk_result& r) {
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
  for (auto& f : r.failures) {  // in order, within the chunk (malformed() checked)
    flush(f.index);
    seg = f.index + 1;
    auto attempts = x.attempt + 1;
    if (attempts <= pol.retries) {
      piece again;
      again.first = f.index;
      auto at = static_cast<std::size_t>(f.index - x.first);
      auto items = x.items.owned_slice(at, at + 1);
      if (!items) {  // a caller's range its handle took back: the job is being cancelled
        end_job(job, taken_back(job));
        return;
      }
      again.items = std::move(*items);
      again.attempt = attempts;
      again.avoid = p;
      again.not_before = clock_now() + pol.backoff;
      if (pol.backoff.count() > 0) wake_at(again.not_before);
      again.last_error = f.what;
      again.last_where = s.where.str();
      if (io_.planted() != planted_bug::drop_retry || again.first % 7 != 3)
        j.pieces.add_queued(std::move(again));
      j.report.retries += 1;
      {
        std::lock_guard<std::mutex> guard{stats_->mtx};
        stats_->retries += 1;
      }
      trace_instant(p, "retry", "job " + std::to_string(job) + " item " + std::to_string(f.index));
      continue;
    }
    auto what = "producer::work threw on item " + std::to_string(f.index) + " on " + s.where.str() +
                " (producer " + std::to_string(p) + ")" +
                (attempts > 1 ? " at each of " + std::to_string(attempts) + " attempts" : "") +
                ": " + f.what;
    if (!pol.skips) {
      end_job(job, std::make_exception_ptr(work_error(what, f.index, s.where.str())));
      return;
    }
    j.report.failures.push_back(item_failure{f.index, f.what, s.where.str(), attempts});
    {
      std::lock_guard<std::mutex> guard{stats_->mtx};
      stats_->skipped_items += 1;
    }
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

void scheduler::deliver_part(job_state& j, std::uint64_t first, std::size_t n, const batch& outputs,
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

void scheduler::deliver(job_state& j, std::uint64_t first, std::size_t n, batch outputs) {
  if (!j.ordered) {
    send_to_consumer(j, std::move(outputs));
    return;
  }
  j.reorder.add(first, n, std::move(outputs));
  release(j);
}

void scheduler::release(job_state& j) {
  j.reorder.release([&](batch b) { send_to_consumer(j, std::move(b)); });
}

void scheduler::emit(producer_event::kind kind, std::size_t p, std::string reason) {
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

void scheduler::producer_failed(std::size_t p, std::uint64_t gen, const std::string& why,
                                bool unreachable) {
  if (producers_[p].gen == gen && producers_[p].state != slot_state::restarting)
    give_up(p, why, unreachable);
}

void scheduler::producer_down(std::size_t p, const std::string& why, bool unreachable) {
  if (producers_[p].state == slot_state::restarting) return;
  bool ending = end_pending(producers_[p].state);
  give_up(p, why, unreachable);
  // Gone while its end() was awaited (a drain, a close): a producer whose node died never
  // answers (CAF 0.17 fails no request to a dead node), and remove() or close() waited
  // close_timeout for it. Its end is taken as failed now.
  if (ending && end_pending(producers_[p].state))
    producer_ended(p, "it went down before producer::end() answered (" + why + ")");
}

void scheduler::give_up(std::size_t p, const std::string& why, bool unreachable, bool quarantine,
                        producer_event::kind kind) {
  auto& s = producers_[p];
  if (!alive(s.state)) return;
  if (quarantine) kind = producer_event::kind::quarantined;
  bool was_leaving = leaving(move(p, quarantine ? slot_event::quarantine : slot_event::lose));
  s.gen += 1;
  room_changed(p);
  bool replace = s.local && !closing_ && !quarantine && !was_leaving &&
                 s.restarts_in_row < max_restarts_in_row;
  if (quarantine)
    log(log_level::warn, "producer " + std::to_string(p) + " on " + s.where.str() +
                             " is quarantined: its work() threw " +
                             std::to_string(s.failures_in_row) +
                             " times in a row (options::quarantine_after); its work goes to "
                             "the others");
  else
    log(log_level::warn, "producer " + std::to_string(p) + " on " + s.where.str() + " is " +
                             (unreachable ? "unreachable" : "lost") + " (" + why +
                             "); its work goes to the others" +
                             (replace ? ", and a fresh producer replaces it" : ""));
  {
    std::lock_guard<std::mutex> guard{stats_->mtx};
    stats_->value.producers[p].alive = false;
    stats_->value.producers[p].quarantined = quarantine;
  }
  stats_->presence.fetch_add(1, std::memory_order_release);
  emit(kind, p,
       quarantine ? "work() threw " + std::to_string(s.failures_in_row) +
                        " times in a row (options::quarantine_after)"
                  : why);
  trace_instant(p,
                quarantine                                ? "quarantined"
                : kind == producer_event::kind::timed_out ? "timed out"
                                                          : "lost",
                why);
  requeue_outstanding(p);
  if (s.local || quarantine)
    io_.stop_producer(p);
  else  // its proxy was kept for the runner's life: part of a membership change's memory
    io_.forget_producer(p);
  if (replace) restart(p);
  if (!s.local) s.release();  // a remote slot is never replaced (its node's rejoin adds slots)
  if (was_leaving) retire(p, "lost while it drained: " + why);  // its chunks went to the others
  check_survivors();
  pump();
}

void scheduler::requeue_outstanding(std::size_t p) {
  auto& s = producers_[p];
  for (auto& rec : s.outstanding) {
    auto ji = jobs_.find(rec.job);
    if (ji == jobs_.end()) continue;
    if (ji->second->pieces.drop_holder(rec.id, p)) ji->second->report.redispatched += rec.items;
    touch(*ji->second);
  }
  s.outstanding.clear();
  s.items = 0;
  room_changed(p);
}

void scheduler::quarantine_producer(std::size_t p) {
  give_up(p, "quarantined", false, true);
}

void scheduler::restart(std::size_t p) {
  auto& s = producers_[p];
  try {
    io_.replace_producer(p, s.gen + 1);
  } catch (const std::exception& e) {
    log(log_level::error, "cannot replace the producer on " + s.where.str() + ": " + e.what());
    return;
  }
  move(p, slot_event::restart);
  s.restarts_in_row += 1;
  s.gen += 1;
}

void scheduler::replaced(std::size_t p, std::uint64_t gen) {
  auto& s = producers_[p];
  if (s.gen != gen) return;
  if (closing_) {
    move(p, slot_event::replace_failed);
    io_.stop_producer(p);
    return;
  }
  move(p, slot_event::replaced);
  s.outstanding.clear();
  s.items = 0;
  room_changed(p);
  {
    std::lock_guard<std::mutex> guard{stats_->mtx};
    auto& ps = stats_->value.producers[p];
    ps.alive = true;
    ps.restarts += 1;
  }
  stats_->presence.fetch_add(1, std::memory_order_release);
  log(log_level::info,
      "producer " + std::to_string(p) + " on " + s.where.str() + " was replaced by a fresh one");
  emit(producer_event::kind::replaced, p, "a fresh producer on the same device");
  trace_instant(p, "replaced", "a fresh producer on the same device");
  pump();
}

void scheduler::replace_failed(std::size_t p, std::uint64_t gen, const std::string& why) {
  auto& s = producers_[p];
  if (s.gen != gen) return;
  move(p, slot_event::replace_failed);
  log(log_level::error,
      "the replacement producer on " + s.where.str() + " failed to start: " + why);
  check_survivors();
  pump();
}

void scheduler::check_survivors() {
  // At close, the jobs left are in consumer::end(): they need no producer (finish_close ends
  // what has not answered by then).
  if (jobs_.empty() || closing_) return;
  if (std::any_of(producers_.begin(), producers_.end(),
                  [](auto& s) { return takes_work(s.state); }))
    return;
  // A producer being drained still delivers the chunks it holds: the jobs fail (if they still
  // need someone) once it has gone (retire() looks again).
  if (std::any_of(producers_.begin(), producers_.end(),
                  [](auto& s) { return leaving(s.state) && !s.outstanding.empty(); }))
    return;
  // Each removed or drained on purpose (every node sent SIGTERM at once), or some lost.
  bool none_lost = std::all_of(producers_.begin(), producers_.end(), [](auto& s) {
    return s.state == slot_state::retired || leaving(s.state);
  });
  std::string what = none_lost ? "every producer has left: each was removed or drained ("
                               : "every producer is lost (";
  bool all_local = true;
  bool any_quarantined = false;
  bool first = true;
  for (std::size_t i = 0; i < producers_.size(); ++i) {
    auto state = producers_[i].state;
    if (state == slot_state::retired && !none_lost) continue;  // removed on purpose
    what += (first ? "" : ", ") + producers_[i].where.str() +
            (state == slot_state::quarantined ? ": quarantined" : "") +
            (leaving(state) && !none_lost ? ": being removed" : "");
    first = false;
    all_local = all_local && producers_[i].local;
    any_quarantined = any_quarantined || state == slot_state::quarantined;
  }
  what += "); the job's remaining work could not be done: ";
  what += none_lost         ? "drain nodes a few at a time (a rolling restart), or add producers "
                              "(add_devices) before the last ones leave"
          : any_quarantined ? "quarantined producers threw options::quarantine_after times in a "
                              "row; create a new runner"
          : all_local       ? "their replacements were stuck too or failed to start (see the "
                              "log); create a new runner"
                            : "create a new runner, with reachable nodes";
  // A job whose every item has come back needs no producer: its consumer finishes it (its
  // last producer drained as its last answer came in, and the job failed).
  std::vector<std::uint64_t> stuck;
  for (auto& [id, j] : jobs_)
    if (!all_through(*j)) stuck.push_back(id);
  for (auto id : stuck) end_job(id, std::make_exception_ptr(node_error(what)));
}

}  // namespace troupe::detail
