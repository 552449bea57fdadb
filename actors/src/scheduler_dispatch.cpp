// The scheduler (scheduler.hpp): which chunk goes to which producer, by fair share, room and
// the reorder window; speculative copies of late chunks; wakeups.
#include <algorithm>
#include <cmath>

#include "scheduler.hpp"

namespace troupe::detail {

bool scheduler::consumer_has_room(const job_state& j) const {
  return j.pending.empty() && j.backlog() < opts_.consumer_backlog;
}

bool scheduler::window_open(const job_state& j) const {
  return consumer_has_room(j) && (!j.ordered || j.pieces.size() + j.reorder.size() < window());
}

bool scheduler::only_choice(std::size_t p) const {
  for (std::size_t i = 0; i < producers_.size(); ++i)
    if (i != p && takes_work(producers_[i].state)) return false;
  return true;
}

bool scheduler::has_work_for(const job_state& j, std::size_t p, clock_type::time_point now) const {
  if (!consumer_has_room(j)) return false;
  // only_choice() scans every producer: asked only when a queued piece avoids `p`.
  return j.pieces.has_queued(p, now, false) ||
         (j.pieces.queued() > 0 && only_choice(p) && j.pieces.has_queued(p, now, true)) ||
         (!j.exhausted && window_open(j));
}

bool scheduler::may_have_work(const job_state& j) const {
  return consumer_has_room(j) && (j.pieces.queued() > 0 || (!j.exhausted && window_open(j)));
}

void scheduler::touch(job_state& j) {
  share_.set_ready(j.id, may_have_work(j));
  touched_.push_back(j.id);
}

void scheduler::pump() {
  if (closing_) return;
  settle();
  // Passes over the producers with room, the least loaded first, one chunk each, until a pass
  // sends nothing. They are read from room_ in order (sorting every producer once per event was
  // most of the scheduler's time with thousands of them), and a pass stops as soon as no job
  // has work and no late chunk can be split or copied (only an idle producer takes one, and the
  // idle ones come first) before some later time: thousands of producers with room at a job's
  // tail would each be asked in vain.
  if (in_pass_) {  // called from inside a pass: the pass goes on, and then another one
    pass_again_ = true;
    return;
  }
  bool sent = true;
  while (sent || std::exchange(pass_again_, false)) {
    sent = false;
    auto now = clock_now();
    update_room();
    struct in_pass {
      bool& flag;
      ~in_pass() { flag = false; }
    } reading{in_pass_ = true};
    for (auto& key : room_) {
      auto p = std::get<2>(key);  // its key may be stale: it stays in place until the pass ends
      if (!batching() && !share_.any_ready() &&
          (!producers_[p].outstanding.empty() || !late_chunks_possible(now)))
        break;  // (a stale key that ends the pass early: it sent a chunk, so a pass follows)
      if (has_room(producers_[p]) && dispatch_to(p, now)) sent = true;
    }
  }
  settle();
}

void scheduler::settle() {
  while (!touched_.empty()) {
    auto batch_ids = std::move(touched_);
    touched_.clear();
    std::sort(batch_ids.begin(), batch_ids.end());
    batch_ids.erase(std::unique(batch_ids.begin(), batch_ids.end()), batch_ids.end());
    for (auto id : batch_ids) {
      auto ji = jobs_.find(id);
      if (ji == jobs_.end()) continue;
      auto& j = *ji->second;
      flush_consumer(j);
      maybe_finish(id);
      // Flushing emptied `pending`: the job may take a producer again. (touch() marked it
      // before, while its outputs still waited here; without this it stayed unready until the
      // consumer's next acknowledgement, and the producers idled a consumer round trip.)
      share_.set_ready(id, may_have_work(j));
    }
  }
}

bool scheduler::dispatch_to(std::size_t p, clock_type::time_point now) {
  // A free producer with nothing to batch may still take a copy of a late chunk (a producer
  // stuck in work() must not hold its items forever).
  if (batching() && producers_[p].local) return dispatch_batch(p, now) || speculate(p, now);
  auto id = share_.pick(
      [&](std::uint64_t job) { return may_have_work(*jobs_.at(job)); },  // the window, say
      [&](std::uint64_t job) { return has_work_for(*jobs_.at(job), p, now); });
  return id ? dispatch_from(*jobs_.at(*id), p, now) : split_late(p, now) || speculate(p, now);
}

bool scheduler::speculate(std::size_t p, clock_type::time_point now) {
  if (!opts_.speculative || !producers_[p].outstanding.empty()) return false;
  // Every idle producer asks on every event: with thousands of producers idle at a job's tail,
  // scanning every producer's queue for each of them cost O(producers^2) per event. A scan that
  // found nothing late says when the first chunk will be; until then, or until a chunk is sent,
  // nothing can be.
  if (nothing_late_before_ && now < *nothing_late_before_) return false;
  auto floor = std::chrono::duration<double, std::nano>(opts_.target_chunk_time).count() * 10;
  job_state* best_job = nullptr;
  std::uint64_t best_id = 0;
  double most_late = 1;             // elapsed / allowed
  std::optional<double> next_late;  // ns from now until the first chunk becomes late
  for (std::size_t q = 0; q < producers_.size(); ++q) {
    auto& s = producers_[q];
    if (q == p || !alive(s.state) || s.outstanding.empty()) continue;
    // A producer works FIFO: its chunks finish one after the other from when it could start
    // the first one.
    auto began = std::max(s.outstanding.front().sent, s.last_done);
    auto elapsed = std::chrono::duration<double, std::nano>(now - began).count();
    double expected = 0;
    for (auto& rec : s.outstanding) {
      expected += s.chunk_ns_of(rec.job, rec.size());  // by the job's own cost model there
      auto allowed = std::max(floor, opts_.speculation_after * expected);
      if (elapsed <= allowed * most_late) {  // this one and those behind it: on time (yet)
        if (!best_job)
          next_late = std::min(next_late.value_or(allowed - elapsed), allowed - elapsed);
        break;
      }
      auto ji = jobs_.find(rec.job);
      if (ji == jobs_.end()) continue;
      auto* x = ji->second->pieces.find(rec.id);
      if (!x || x->holders.size() != 1 || x->holders[0] == p || x->trimming) continue;
      // Items not started yet are taken back (split_late), not copied: a chunk that can be
      // cut is copied only once its producer, asked for the items it has not started, has
      // neither looked nor started an item for 10 target chunk times (it is stuck in one).
      if (rec.cut && rec.asked && rec.cut->started() != rec.asked_started) {
        rec.asked = now;  // it works on: not stuck
        rec.asked_started = rec.cut->started();
      }
      // A node's chunk that was trimmed: copied once a trim has found every item claimed for
      // 10 target chunk times (stuck in one), or 10 after the last trim that took items.
      auto trimmed_lately = [&] {
        auto within = [&](const std::optional<clock_type::time_point>& t) {
          return t && now - *t < 10 * opts_.target_chunk_time;
        };
        return rec.asked ? within(rec.asked) : within(rec.taken);
      };
      if ((rec.cut && (rec.cut->unclaimed() > 0 || !rec.cut->wanted() || !rec.asked ||
                       now - *rec.asked < 10 * opts_.target_chunk_time)) ||
          (!rec.cut && rec.cut_id != 0 && trimmed_lately())) {
        // Look again when it may be (split_late asks its producer meanwhile).
        auto since = rec.asked ? rec.asked : rec.cut ? std::nullopt : rec.taken;
        auto wait = std::chrono::duration<double, std::nano>(
                        since ? *since + 10 * opts_.target_chunk_time - now
                              : clock_type::duration{10 * opts_.target_chunk_time})
                        .count();
        wait = std::max(wait, floor / 10);
        if (!best_job) next_late = std::min(next_late.value_or(wait), wait);
        continue;
      }
      best_job = ji->second.get();
      best_id = rec.id;
      most_late = elapsed / allowed;
    }
  }
  if (!best_job) {
    // Nothing is late yet: look again when the first chunk would be (in a day at most: a huge
    // speculation_after or troupe_cost would not fit the clock's nanoseconds).
    if (next_late) next_late = std::min(*next_late, 86'400e9);
    nothing_late_before_ =
        next_late ? now + std::chrono::duration_cast<clock_type::duration>(
                              std::chrono::duration<double, std::nano>(std::floor(*next_late)))
                  : clock_type::time_point::max();
    if (next_late) {
      auto at = now + std::chrono::duration_cast<clock_type::duration>(
                          std::chrono::duration<double, std::nano>(std::ceil(*next_late)));
      if (!speculation_check_ || *speculation_check_ <= now || at < *speculation_check_) {
        speculation_check_ = at;
        wake_at(at);
      }
    }
    return false;
  }
  auto n = best_job->pieces.find(best_id)->items.size();
  trace_instant(p, "speculative copy",
                "job " + std::to_string(best_job->id) + ", " + std::to_string(n) + " items");
  {
    std::lock_guard<std::mutex> guard{stats_->mtx};
    stats_->value.duplicated_items += n;
  }
  send(p, *best_job, best_id);
  return true;
}

bool scheduler::dispatch_batch(std::size_t p, clock_type::time_point now) {
  auto& s = producers_[p];
  if (!s.outstanding.empty()) return false;  // items wait for its next call: a fuller batch
  auto& b = opts_.batching;
  // What waits for this producer, and since when.
  std::size_t waiting = 0;
  std::optional<clock_type::time_point> oldest;
  for (auto& [id, j] : jobs_) {
    if (!has_work_for(*j, p, now)) continue;
    std::size_t n = j->pieces.queued();
    if (!j->exhausted) {
      auto total = j->source->total();
      if (total && *total <= j->next_item) {
        // All its items have gone (an empty input: none ever): no pull will come to find out
        // that it has ended, so it ends here (settle() finishes it once its answers are in;
        // pieces queued again, of a lost producer, still count below).
        j->exhausted = true;
        touch(*j);
      } else {
        n += total ? static_cast<std::size_t>(*total - j->next_item)
                   : b.max_items;  // a generator: assume plenty
      }
    }
    if (n == 0) continue;
    waiting += n;
    if (!oldest || j->started < *oldest) oldest = j->started;
  }
  if (waiting == 0) return false;
  auto target = b.max_items;
  if (waiting < b.max_items) {
    std::size_t preferred = 0;
    for (auto size : b.preferred_sizes)
      if (size <= waiting) preferred = std::max(preferred, size);
    if (preferred > 0) {
      target = preferred;
    } else if (b.max_delay.count() > 0 && *oldest + b.max_delay > now) {
      auto at = *oldest + b.max_delay;  // then it goes with whatever waits
      if (!batch_check_ || *batch_check_ <= now || at < *batch_check_) {
        batch_check_ = at;
        wake_at(at);
      }
      return false;
    } else {
      target = waiting;
    }
  }
  std::vector<grouped_chunk> group;
  group_ = &group;
  std::size_t taken = 0;
  while (taken < target) {
    auto id = share_.pick([&](std::uint64_t job) { return may_have_work(*jobs_.at(job)); },
                          [&](std::uint64_t job) { return has_work_for(*jobs_.at(job), p, now); });
    if (!id) break;
    auto before = s.items;
    auto chunks = s.outstanding.size();
    if (!dispatch_from(*jobs_.at(*id), p, now, target - taken)) break;
    if (s.outstanding.size() == chunks) continue;  // the job ended, or had nothing after all
    taken += s.items - before;
  }
  group_ = nullptr;
  auto k = static_cast<std::uint32_t>(group.size());
  if (k > 0) {  // held from when both the producer was free and an item waited, until now
    auto hold = now - std::max(*oldest, s.last_done);
    std::lock_guard<std::mutex> guard{stats_->mtx};
    auto& v = stats_->value;
    v.batched_calls += 1;
    if (hold > v.longest_batch_hold)
      v.longest_batch_hold = std::chrono::duration_cast<std::chrono::nanoseconds>(hold);
    stats_->batch_hold.observe(std::max(0.0, std::chrono::duration<double>(hold).count()));
  }
  for (std::uint32_t i = 0; i < k; ++i) {
    group[i].msg.group_size = k;
    group[i].msg.group_pos = i;
    io_.send_chunk(group[i].p, group[i].gen, group[i].id, std::move(group[i].msg));
  }
  return k > 0;
}

bool scheduler::dispatch_from(job_state& j, std::size_t p, clock_type::time_point now,
                              std::optional<std::size_t> limit) {
  // only_choice() scans every producer: asked only when every queued piece avoids `p`.
  auto queued = j.pieces.take_queued(p, now, false);
  if (!queued && j.pieces.queued() > 0 && only_choice(p))
    queued = j.pieces.take_queued(p, now, true);
  if (queued) {
    send(p, j, *queued);
    return true;
  }
  auto& s = producers_[p];
  piece x;
  try {
    if (s.local && j.fold && j.source->lease())
      x.items = j.source->pull(folded_chunk_limit(j, s), std::numeric_limits<std::size_t>::max(),
                               opts_.target_chunk_time);
    else {
      auto n = limit ? *limit : new_job_limit(j, s);
      // Items with troupe_cost: the model counts units of the job's cost (cost_unit), and a
      // chunk of n units is cut once its items cost n units (heavy items make short chunks).
      bool by_cost = j.source->costed() && !limit && !settings_.chunk_size &&
                     !settings_.max_in_flight && j.cost_unit > 0;
      j.source->limit_cost(by_cost ? static_cast<double>(n) * j.cost_unit
                                   : std::numeric_limits<double>::infinity());
      // (A chunk of a costed job not cut by cost takes n units as items: at most
      // max_chunk_items, which the model's units do not bound.)
      auto most = by_cost              ? settings_.max_chunk_items
                  : j.source->costed() ? std::min(n, settings_.max_chunk_items)
                                       : n;
      x.items = j.source->pull(most, opts_.max_chunk_bytes, opts_.target_chunk_time);
      if (j.source->costed() && !x.items.empty()) {
        auto cost = j.source->last_cost();
        auto n_items = static_cast<double>(x.items.size());
        if (j.cost_unit <= 0) j.cost_unit = cost > 0 && std::isfinite(cost) ? cost / n_items : 1.0;
        // At most a billion units an item: numbers the limits and the model can count in. (Items
        // a billion times costlier than the first chunk's, or of infinite cost, then go one per
        // chunk: exact, but slow.)
        auto units = std::isfinite(cost) ? cost / j.cost_unit : 1e9 * n_items;
        x.units = std::clamp(units, 1e-3, std::max(1e-3, 1e9 * n_items));
        j.units_pulled += x.units;
        j.items_costed += x.items.size();
      }
    }
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
  unqueue(j, x.items.size());
  j.report.items = j.next_item;
  // Items of a known-size input wait from the job's start; a generator's are made now.
  send(p, j, j.pieces.add(std::move(x)),
       j.source->total() ? now - j.started : clock_type::duration::zero());
  return true;
}

void scheduler::send(std::size_t p, job_state& j, std::uint64_t id,
                     std::optional<clock_type::duration> first_wait) {
  auto& s = producers_[p];
  auto& x = *j.pieces.find(id);
  // A caller's range is lent to local producers only: a node gets a copy (its message is
  // written later, on the network's thread).
  if (!s.local && x.items.lease()) {
    auto items = x.items.owned_slice(0, x.items.size());
    if (!items) {  // its handle took the range back: the job is being cancelled
      end_job(j.id, taken_back(j.id));
      return;
    }
    x.items = std::move(*items);
  }
  x.holders.push_back(p);
  nothing_late_before_.reset();  // this chunk may be late before the others
  no_split_before_.reset();      // or worth splitting
  sent_chunk rec;
  rec.job = j.id;
  rec.id = id;
  rec.items = x.items.size();
  rec.units = x.units;
  rec.sent = clock_now();
  rec.behind = s.outstanding.size();
  rec.bytes = x.items.get() ? x.items.get()->flat_bytes().value_or(opts_.max_chunk_bytes) : 0;
  // A chunk an idle producer may take items of (not a part of a batched call; a folded one
  // too: its producer claims items before it folds them).
  if (s.cuts && group_ == nullptr && rec.items > 0 && rec.items <= chunk_cut::max_items) {
    if (s.local)
      rec.cut = std::make_shared<chunk_cut>(rec.items);
    else
      rec.cut_id = ++next_cut_id_;  // a node's: trimmed there (trim_remote)
  }
  s.outstanding.push_back(rec);
  s.items += rec.items;
  room_changed(p);
  {  // both counts at once: a scrape never sees a first send without its send
    std::lock_guard<std::mutex> guard{stats_->mtx};
    stats_->chunks_sent += 1;
    if (!s.local) {
      auto flat = x.items.get() ? x.items.get()->flat_bytes() : std::optional<std::size_t>{0};
      if (flat)
        stats_->node_bytes_sent += *flat;
      else
        stats_->node_chunks_unsized += 1;
    }
    if (first_wait) {
      stats_->chunks_first_sent += 1;
      stats_->queue_wait.observe(std::max(0.0, std::chrono::duration<double>(*first_wait).count()));
    }
  }
  if (trace_) trace_->dispatch(p, flow_id(j.id, id), rec.sent);
  auto cost = s.rate(j.id) ? s.chunk_ns_of(j.id, rec.size())
                           : static_cast<double>(rec.items) *
                                 (s.ns_per_item > 0 ? s.ns_per_item : unknown_ns_per_item);
  share_.charge(j.id, cost, static_cast<double>(j.opts.weight));
  touch(j);
  auto gen = s.gen;
  auto job = j.id;
  work_chunk w{job, x.first, x.items, !j.opts.on_error.fails_fast(), nullptr};
  if (j.fold) w.fold = j.gate;
  w.cut = rec.cut;
  w.cut_id = rec.cut_id;
  if (group_ != nullptr) {  // dispatch_batch sends the group once it is complete
    group_->push_back(grouped_chunk{p, gen, id, std::move(w)});
    return;
  }
  io_.send_chunk(p, gen, id, std::move(w));
}

void scheduler::wake_at(clock_type::time_point t) {
  if (auto hook = fault_points::before_wake.load()) hook();
  // A time already passed (the caller read the clock earlier in this event, and the thread may
  // have been preempted since) still wakes this actor, 100 us from now: never dropped (that hung
  // a job once), never at once (in virtual time, a simulation, a wakeup at the same instant
  // could find the same state and ask again, forever).
  auto now = clock_now();
  if (t <= now && io_.planted() == planted_bug::wake_at_once) {
    io_.set_timer(std::chrono::nanoseconds{0}, scheduler_io::timer::wakeup, 0);
    return;
  }
  auto until = t > now ? std::chrono::duration_cast<std::chrono::microseconds>(t - now)
                       : std::chrono::microseconds{0};
  io_.set_timer(until + std::chrono::microseconds{100}, scheduler_io::timer::wakeup, 0);
}

}  // namespace troupe::detail
