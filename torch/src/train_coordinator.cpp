// The training coordinator's step (train_coordinator.hpp): a pure state machine.
#include "train_coordinator.hpp"

#include <algorithm>

namespace troupe::detail::train_core {

planted_mistake& planted() {
  static planted_mistake p = planted_mistake::none;
  return p;
}

namespace {
bool planted_is(planted_mistake m) {
  return planted() == m;
}
}  // namespace

std::vector<std::size_t> train_coordinator::alive() const {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < replicas_.size(); ++i)
    if (replicas_[i].alive) out.push_back(i);
  return out;
}

void train_coordinator::begin(const step_input& in, std::vector<replica_info> replicas, ns now,
                              train_io& io) {
  in_ = in;
  io_ = &io;
  now_ = now;
  replicas_ = std::move(replicas);
  shards_ = (in.samples + in.shard_size - 1) / in.shard_size;
  pending_.clear();
  failure_.reset();
  apply_failure_.reset();
  broken_.reset();
  counts_ = {};
  result_ = {};
  plane_ = false;
  auto live = alive();
  if (live.empty()) return finish(end::no_replica);
  mode_ = in.local ? reduce_mode::local
                   : (in.deterministic ? reduce_mode::deterministic : reduce_mode::fast);
  if (mode_ == reduce_mode::fast) {
    bool remote = false;
    for (auto i : live) remote = remote || !replicas_[i].local;
    if (transport_.ring(in.steps_done, live.size(), in.grad_bytes, remote))
      mode_ = reduce_mode::ring;
  }
  start_compute();
}

void train_coordinator::start_compute() {
  phase_ = phase::backward;
  io_->begin_attempt(mode_);
  book_ = ledger{shards_, mode_ == reduce_mode::ring};
  stepped_.clear();
  used_.clear();
  given_up_.clear();
  auto live = alive();
  for (auto& x : split(0, shards_, live, rates_of(live), mode_ == reduce_mode::local))
    dispatch(x.who, x.a, x.b);
  backward_maybe_done();
}

std::vector<double> train_coordinator::rates_of(const std::vector<std::size_t>& who) const {
  std::vector<double> rates;
  for (auto i : who) rates.push_back(replicas_[i].rate);
  return rates;
}

void train_coordinator::dispatch(std::size_t who, std::uint64_t a, std::uint64_t b) {
  auto id = io_->backward(who, a, b);
  pending_[id] = request{kind::backward, who, now_, a, b};
  book_.sent(id, who, a, b);
}

void train_coordinator::recompute(const std::vector<range>& ranges) {
  auto rest = alive();
  if (rest.empty()) return;
  auto rates = rates_of(rest);
  for (auto [a, b] : ranges) {
    counts_.recomputed_shards += b - a;
    for (auto& x : split(a, b, rest, rates, false)) dispatch(x.who, x.a, x.b);
  }
}

void train_coordinator::answered(std::uint64_t id, bool ok, double busy_seconds, ns now) {
  now_ = now;
  auto it = pending_.find(id);
  if (it == pending_.end() || finished()) {
    // Given up on (its replica lost, its ring broken), or answered already: ignored, unless a
    // mistake is planted.
    if (finished() || phase_ != phase::backward) return;
    if (planted_is(planted_mistake::late_answer_used) && given_up_.count(id))
      io_->take(id, given_up_[id]);
    if (planted_is(planted_mistake::duplicate_used) && used_.count(id)) io_->take(id, used_[id]);
    return;
  }
  auto r = it->second;
  pending_.erase(it);
  switch (r.k) {
    case kind::backward: {
      if (!ok) {
        if (!failure_) failure_.emplace(r.who, id);
        book_.failed(id);
        backward_maybe_done();
        return;
      }
      auto x = book_.answered(id);
      if (!x) return;
      if (planted() != planted_mistake::none) used_[id] = *x;
      io_->take(id, *x);
      auto& rep = replicas_[r.who];
      if (busy_seconds > 0) {
        double rate = static_cast<double>(x->b - x->a) / busy_seconds;
        rep.rate = rep.rate > 0 ? 0.5 * rep.rate + 0.5 * rate : rate;
      }
      if (mode_ == reduce_mode::local) stepped_.push_back(r.who);
      return backward_maybe_done();
    }
    case kind::ring:
      if (!ok) {
        // Over the data plane most often a neighbour lost (its connection closed before the
        // coordinator heard of it): the step's recomputation tells.
        io_->log(!plane_, plane_ ? "a ring over the data plane failed; reducing this step "
                                   "through the coordinator"
                                 : "a ring all-reduce failed; reducing through the coordinator "
                                   "from now on");
        ring_broken(plane_ ? transport_policy::ring_end::plane_failed
                           : transport_policy::ring_end::failed);
        return;
      }
      for (auto& [rid, q] : pending_)
        if (q.k == kind::ring) return;  // others still reducing
      counts_.ring_reductions += 1;
      if (plane_) counts_.direct_ring_reductions += 1;
      transport_.ended(transport_policy::ring_end::done, in_.steps_done);
      counts_.reduce += now_ - ring_started_;
      start_apply();
      return;
    case kind::apply:
      if (!ok) {
        // Its step() threw after others applied theirs: it no longer matches them.
        if (!apply_failure_) apply_failure_.emplace(r.who, id);
        if (replicas_[r.who].alive) {
          replicas_[r.who].alive = false;
          counts_.lost += 1;
          io_->drop(r.who, /*abandon=*/false);
        }
      }
      apply_maybe_done();
      return;
  }
}

void train_coordinator::lost(std::size_t who, ns now) {
  now_ = now;
  if (who >= replicas_.size() || !replicas_[who].alive || finished()) return;
  replicas_[who].alive = false;
  counts_.lost += 1;
  bool in_ring = false;
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second.who != who) {
      ++it;
      continue;
    }
    in_ring = in_ring || it->second.k == kind::ring;
    if (it->second.k == kind::backward && planted() != planted_mistake::none)
      given_up_[it->first] = share{who, it->second.a, it->second.b};
    it = pending_.erase(it);
  }
  switch (phase_) {
    case phase::backward: {
      if (failure_) return backward_maybe_done();  // the step fails: nothing to compute again
      auto back = book_.lost(who);
      if (mode_ == reduce_mode::local) {
        // Its own update is gone with it: its samples (the last shard may be short) leave
        // the mean loss.
        for (auto [a, b] : back)
          counts_.lost_samples += std::min(b * in_.shard_size, in_.samples) - a * in_.shard_size;
        return backward_maybe_done();
      }
      if (planted_is(planted_mistake::recompute_answered) && mode_ != reduce_mode::ring)
        for (auto& [id, s] : used_)
          if (s.who == who) back.push_back({s.a, s.b});
      if (!planted_is(planted_mistake::no_recompute)) recompute(back);
      return backward_maybe_done();
    }
    case phase::ring:
      if (in_ring) ring_broken(transport_policy::ring_end::lost);
      return;
    case phase::apply:
      return apply_maybe_done();
    default:
      return;
  }
}

void train_coordinator::backward_maybe_done() {
  if (phase_ != phase::backward) return;
  for (auto& [id, r] : pending_)
    if (r.k == kind::backward) return;
  if (broken_) {
    // What the broken ring teaches, now that the step was computed again (and whether a
    // replica was lost meanwhile) is known; also when the step fails.
    auto pause = transport_.next_pause();
    auto d = transport_.ended(*broken_, in_.steps_done, counts_.lost != lost_before_);
    broken_.reset();
    if (d == transport_policy::decision::paused)  // a ring too slow though each answers alone
      io_->log(true, "the next " + std::to_string(pause) + " steps reduce through the coordinator");
    if (d == transport_policy::decision::plane_off)  // a data port the others cannot reach
      io_->log(true,
               "a ring over the replicas' data ports failed while every replica answered; rings "
               "go through CAF from now on");
  }
  if (failure_) return finish(end::backward_failed, failure_->first, failure_->second);
  if (alive().empty()) return finish(end::every_replica_lost);
  if (mode_ != reduce_mode::local) {
    if (auto s = book_.incomplete())
      return finish(end::internal, 0, 0,
                    "internal: shard " + std::to_string(*s) + " of the step is counted " +
                        std::to_string(book_.count(*s)) + " times");
  }
  if (mode_ == reduce_mode::ring) return start_ring();
  start_apply();
}

void train_coordinator::start_ring() {
  ring_started_ = now_;  // (a ring that cannot start counts no reduce time either)
  auto ring = alive();
  if (ring.size() < 2) return ring_broken(transport_policy::ring_end::lost);
  phase_ = phase::ring;
  bool ports = true;
  for (auto i : ring) ports = ports && !replicas_[i].local && replicas_[i].has_port;
  plane_ = transport_.plane(o_.direct_ring, ports);
  auto ids = io_->ring(ring, plane_);
  for (std::size_t k = 0; k < ids.size() && k < ring.size(); ++k)
    pending_[ids[k]] = request{kind::ring, ring[k], now_};
}

void train_coordinator::ring_broken(transport_policy::ring_end why) {
  // The partial sums are half reduced: the whole step again, on the survivors, summed by the
  // coordinator. The ring's other members wait for pieces that will not come: given up on.
  for (auto it = pending_.begin(); it != pending_.end();)
    it = it->second.k == kind::ring ? pending_.erase(it) : std::next(it);
  counts_.reduce += now_ - ring_started_;
  if (planted_is(planted_mistake::broken_ring_used) && why != transport_policy::ring_end::lost)
    return start_apply();
  if (planted_is(planted_mistake::ring_after_failure) && why == transport_policy::ring_end::failed)
    why = transport_policy::ring_end::lost;
  broken_ = why;
  lost_before_ = counts_.lost;
  mode_ = reduce_mode::fast;
  counts_.recomputed_shards += shards_;
  start_compute();
}

void train_coordinator::start_apply() {
  phase_ = phase::apply;
  reduce_started_ = now_;
  std::vector<std::size_t> targets;
  if (mode_ == reduce_mode::local) {
    for (auto w : stepped_)
      if (replicas_[w].alive) targets.push_back(w);
  } else {
    if (mode_ != reduce_mode::ring) io_->reduce();
    targets = alive();
  }
  for (auto w : targets) pending_[io_->apply(w)] = request{kind::apply, w, now_};
  apply_maybe_done();
}

void train_coordinator::apply_maybe_done() {
  if (phase_ != phase::apply) return;
  for (auto& [id, r] : pending_)
    if (r.k == kind::apply) return;
  counts_.reduce += now_ - reduce_started_;
  if (apply_failure_)
    return finish(end::apply_failed, apply_failure_->first, apply_failure_->second);
  finish(end::done);
}

void train_coordinator::finish(end e, std::size_t who, std::uint64_t id, std::string what) {
  phase_ = phase::done;
  pending_.clear();
  used_.clear();
  given_up_.clear();
  result_ = outcome{e, who, id, std::move(what)};
}

std::optional<train_coordinator::ns> train_coordinator::deadline() const {
  if (o_.replica_timeout.count() <= 0 || finished()) return std::nullopt;
  if (phase_ == phase::ring) return ring_started_ + o_.replica_timeout;
  std::optional<ns> first;
  for (auto& [id, r] : pending_)
    if (replicas_[r.who].alive && (!first || r.sent < *first)) first = r.sent;
  if (!first) return std::nullopt;
  return *first + o_.replica_timeout;
}

void train_coordinator::tick(ns now) {
  now_ = now;
  if (o_.replica_timeout.count() <= 0 || finished()) return;
  if (phase_ == phase::ring) {
    if (now - ring_started_ < o_.replica_timeout) return;
    // Every member's answer waits for the whole ring, so lateness names no one. The step is
    // computed again through the coordinator, where a frozen replica's own request times out
    // and only it is dropped.
    io_->log(true,
             "ring all-reduce past replica_timeout; reducing this step through the "
             "coordinator");
    return ring_broken(transport_policy::ring_end::timed_out);
  }
  std::vector<std::size_t> late;
  for (auto& [id, r] : pending_)
    if (now - r.sent >= o_.replica_timeout &&
        std::find(late.begin(), late.end(), r.who) == late.end())
      late.push_back(r.who);
  for (auto who : late) {
    if (!replicas_[who].alive) continue;
    io_->drop(who, /*abandon=*/true);
    lost(who, now);
  }
}

}  // namespace troupe::detail::train_core
