// The scheduler (scheduler.hpp): late chunks split for idle producers (options::
// split_late_chunks). Which chunk loses items is split_policy.hpp's choice; the items move through
// the chunk's chunk_cut, each claimed by its producer or taken back here, exactly once.
#include "scheduler.hpp"

namespace troupe::detail {

bool scheduler::split_late(std::size_t p, clock_type::time_point now) {
  if (!producers_[p].cuts || !producers_[p].outstanding.empty()) return false;
  // Like speculate(): a scan that found nothing says when to look again (a send resets it).
  if (no_split_before_ && now < *no_split_before_) return false;
  auto ns = [](clock_type::duration d) {
    return std::chrono::duration<double, std::nano>(d).count();
  };
  struct place {
    job_state* j;
    std::size_t q, k;
  };
  std::vector<split_candidate> cs;
  std::vector<place> at;
  bool any_cut = false;  // a chunk that may be worth it later (its consumer busy now, say)
  double longest = 0;    // the longest a producer has been on its current chunk
  std::size_t idle = 1;  // producers with nothing to do, p with them
  for (std::size_t q = 0; q < producers_.size(); ++q) {
    auto& s = producers_[q];
    if (q != p && takes_work(s.state) && s.outstanding.empty()) ++idle;
    if (q == p || !alive(s.state) || s.outstanding.empty()) continue;
    auto elapsed = ns(now - std::max(s.outstanding.front().sent, s.last_done));
    longest = std::max(longest, elapsed);
    // The chunks queued behind one that runs late wait at least as long again.
    auto front_late = elapsed > std::max(ns(opts_.target_chunk_time) / 8,
                                         2 * s.chunk_ns_of(s.outstanding.front().job,
                                                           s.outstanding.front().size()));
    for (std::size_t k = 0; k < s.outstanding.size(); ++k) {
      auto& rec = s.outstanding[k];
      if (!rec.cut && rec.cut_id == 0) continue;
      any_cut = true;
      if (rec.trimming || (rec.trim_again && now < *rec.trim_again))
        continue;  // a trim is on its way to its node, or one took nothing a moment ago
      auto ji = jobs_.find(rec.job);
      if (ji == jobs_.end() || !consumer_has_room(*ji->second)) continue;
      auto* x = ji->second->pieces.find(rec.id);
      if (!x || x->holders.size() != 1 || x->holders[0] != q) continue;
      if (x->avoid && *x->avoid == p && !only_choice(p)) continue;
      split_candidate c;
      c.position = k;
      c.model_ns_per_item = s.rate(rec.job) ? s.ns_per_item_of(rec.job) : 0;
      c.expected_ns = s.chunk_ns_of(rec.job, rec.size());
      c.elapsed_ns = k == 0 ? elapsed : 0;
      if (rec.cut) {
        c.unclaimed = rec.cut->unclaimed();
        c.claimed = rec.cut->next();
      } else {
        // A node's chunk: its progress is not seen here. The one being worked has done about
        // its time so far by the job's cost there (unknown: not a candidate yet).
        if (k == 0 && c.model_ns_per_item <= 0) continue;
        auto done = k == 0 ? static_cast<std::uint64_t>(elapsed / c.model_ns_per_item) + 1 : 0;
        c.claimed = std::min<std::uint64_t>(done, rec.items);
        c.unclaimed = rec.items - c.claimed;
      }
      c.wait_ns = k > 0 && front_late ? elapsed : 0;
      if (k == 0) {  // its pace since the last look (a look at least an eighth target apart)
        if (rec.looked) {
          auto dt = ns(now - *rec.looked);
          auto dn = c.claimed > rec.looked_next ? c.claimed - rec.looked_next : 0;
          c.recent_ns_per_item = dt / static_cast<double>(std::max<std::uint64_t>(1, dn));
        }
        if (!rec.looked || ns(now - *rec.looked) >= ns(opts_.target_chunk_time) / 8) {
          rec.looked = now;
          rec.looked_next = c.claimed;
        }
      }
      if (rec.cut && runs_late(c, ns(opts_.target_chunk_time) / 8)) {
        // Its current grab may hold slow items: asked for the ones it has not started (since
        // when, unless it still has not looked since the last time).
        if (!rec.cut->wanted() || !rec.asked) {
          rec.asked = now;
          rec.asked_started = rec.cut->started();
        }
        rec.cut->ask();
      }
      cs.push_back(c);
      at.push_back(place{ji->second.get(), q, k});
    }
  }
  // Looks again after `after_ns`, or a quarter of the longest a producer has been on its chunk
  // when that is more (a producer stuck for long is not polled thousands of times a second).
  auto target = ns(opts_.target_chunk_time);
  auto look_again = [&](double after_ns) {
    after_ns = std::max(after_ns, longest / 4);
    auto t = now + std::chrono::duration_cast<clock_type::duration>(
                       std::chrono::duration<double, std::nano>(after_ns));
    no_split_before_ = t;
    if (!split_check_ || *split_check_ <= now || t < *split_check_) {
      split_check_ = t;
      wake_at(t);
    }
  };
  auto choice = choose_split(cs, target / 8);
  if (!choice) {
    // Chunks that may become worth it as their items take longer than learned: look again.
    if (!any_cut)
      no_split_before_ = clock_type::time_point::max();
    else
      look_again(target / 4);
    return false;
  }
  auto& w = at[choice->index];
  auto& rec = producers_[w.q].outstanding[w.k];
  if (!rec.cut) {
    // A node's chunk: its node takes the items back (those its producer has not claimed), and
    // the answer (trimmed(), or the chunk's own, whichever comes first) queues them for the
    // next producer with room. Nothing else is taken from it meanwhile, nor copied. Trims go
    // out at once for as many chunks as producers are idle (each idle producer asks in the
    // same pass), no more.
    if (trims_in_flight_ >= idle) {
      look_again(target / 8);
      return false;
    }
    trims_in_flight_ += 1;
    rec.trimming = true;
    w.j->pieces.find(rec.id)->trimming = true;
    io_.trim_remote(w.q, producers_[w.q].gen, rec.job, rec.id, rec.cut_id, rec.items, choice->all,
                    runs_late(cs[choice->index], ns(opts_.target_chunk_time) / 8));
    {
      std::lock_guard<std::mutex> guard{stats_->mtx};
      stats_->value.trims_sent += 1;
    }
    trace_instant(w.q, "trim sent",
                  "job " + std::to_string(rec.job) + ": " + std::to_string(rec.items) +
                      " items, for producer " + std::to_string(p));
    return false;
  }
  auto keep = rec.cut->trim(choice->all);
  if (!keep) {
    // Every item claimed: its producer is asked for those it has not started (it gives them
    // back between two items); look again soon.
    trace_instant(w.q, "asked back",
                  "job " + std::to_string(rec.job) + ": for producer " + std::to_string(p));
    look_again(target / 8);
    return false;
  }
  split_piece(*w.j, w.q, rec, *keep, p);
  return true;
}

void scheduler::trimmed(std::size_t q, std::uint64_t gen, std::uint64_t job, std::uint64_t id,
                        std::int64_t kept) {
  if (trims_in_flight_ > 0) trims_in_flight_ -= 1;  // each trim_remote is answered once
  auto& s = producers_[q];
  // Not when its producer was lost meanwhile (its chunks were queued again whole), nor when
  // the chunk was answered first (its answer said where it ended). Either way an idle producer
  // may send another trim now: the pump goes on.
  auto rec = s.find(job, id);
  if (s.gen == gen && rec != s.outstanding.end()) apply_trim(q, *rec, kept);
  pump();
}

void scheduler::apply_trim(std::size_t q, sent_chunk& rec, std::int64_t kept) {
  rec.trimming = false;
  auto now = clock_now();
  if (kept < 0 || static_cast<std::uint64_t>(kept) >= rec.items) {
    if (!rec.asked) rec.asked = now;  // nothing taken: every item claimed (or done)
    rec.trim_again = now + opts_.target_chunk_time;
  } else {
    rec.asked.reset();
    rec.taken = now;
  }
  auto ji = jobs_.find(rec.job);
  auto* x = ji != jobs_.end() ? ji->second->pieces.find(rec.id) : nullptr;
  if (x) x->trimming = false;
  if (!x || kept < 0 || static_cast<std::uint64_t>(kept) >= rec.items) return;
  split_piece(*ji->second, q, rec, static_cast<std::uint64_t>(kept), std::nullopt);
}

void scheduler::split_piece(job_state& j, std::size_t q, sent_chunk& rec, std::uint64_t keep,
                            std::optional<std::size_t> p) {
  auto& x = *j.pieces.find(rec.id);
  auto n = x.items.size();
  piece y;
  y.first = x.first + keep;
  y.items = x.items.part(static_cast<std::size_t>(keep), n);
  y.attempt = x.attempt;
  y.avoid = x.avoid;
  y.last_error = x.last_error;
  y.last_where = x.last_where;
  x.items = x.items.part(0, static_cast<std::size_t>(keep));
  auto moved = n - static_cast<std::size_t>(keep);
  if (x.units > 0) {  // costs by item are not kept: shared by count
    y.units = x.units * static_cast<double>(moved) / static_cast<double>(n);
    x.units -= y.units;
  }
  rec.items = static_cast<std::size_t>(keep);
  rec.units = x.units;
  producers_[q].items -= moved;
  room_changed(q);
  {
    std::lock_guard<std::mutex> guard{stats_->mtx};
    stats_->value.split_chunks += 1;
    stats_->value.moved_items += moved;
  }
  trace_instant(q, "split",
                "job " + std::to_string(j.id) + ": items " + std::to_string(y.first) + ".." +
                    std::to_string(y.first + moved) +
                    (p ? " to producer " + std::to_string(*p) : std::string{" queued"}));
  if (io_.planted() == planted_bug::split_drops_item && y.items.size() > 1) {
    y.first += 1;
    y.items = y.items.part(1, y.items.size());
  }
  if (keep == 0) {
    // Nothing of it is left to its producer: no longer in flight (its empty answer is dropped),
    // so that a producer stuck ahead of it cannot hold the job.
    j.pieces.take_out(rec.id);
    auto& s = producers_[q];
    s.outstanding.erase(s.find(rec.job, rec.id));
  }
  if (!p) {
    j.pieces.add_queued(std::move(y));
    touch(j);
    return;
  }
  auto id = j.pieces.add(std::move(y));
  send(*p, j, id);
}

}  // namespace troupe::detail
