// Simulated training (troupe/train_simulation.hpp): a discrete-event simulation of the
// coordinator's step on the calling thread. The step's decisions are train_coordinator's, the
// one data_parallel runs (train_coordinator.hpp): this file only carries its commands to
// simulated replicas and their answers back, in virtual time. Every replica is a real
// replica_state, so backward() and apply() are the code real replicas run. Virtual time:
// cost_per_item per sample, jitter per request, faults scripted with simulation::at_step or drawn
#include <algorithm>
#include <queue>

#include "ring_schedule.hpp"
#include "train_sim_impl.hpp"
#include "train_sums.hpp"

namespace troupe::detail {
namespace {

using ns = std::chrono::nanoseconds;
constexpr ns never = ns::max();

}  // namespace

void sim_trainer::impl::lose(std::size_t who, const std::string& why) {
  auto& m = members[who];
  if (!m.alive) return;
  m.alive = false;
  m.rs.lost = true;
  stats.lost_replicas += 1;
  note("lose " + name(who) + ": " + why);
  m.st->release();
}

void sim_trainer::impl::lose_node(const std::string& node, const std::string& why) {
  for (std::size_t i = 0; i < members.size(); ++i)
    if (members[i].d.node() == node) lose(i, why);
}

/// One simulated step's commands (train_coordinator.hpp's train_io): shards scheduled on the
/// simulated replicas in virtual time, their answers computed by the real replica code.
struct sim_trainer::impl::shell final : train_core::train_io {
  shell(impl& s, const batch& samples) : s(s), sums(s.next_id, samples, s.o.shard_size) {}

  std::uint64_t begin_attempt(train_core::reduce_mode m) override { return sums.begin(m); }

  std::uint64_t backward(std::size_t who, std::uint64_t a, std::uint64_t b) override {
    auto id = s.next_id++;
    auto& m = s.members[who];
    s.note("send shards [" + std::to_string(a) + "," + std::to_string(b) + ") to " + s.name(who));
    const double j = 1 + s.jitter * std::uniform_real_distribution<double>(0, 1)(s.rng);
    auto t = std::max({s.now, m.busy_until, m.frozen_until});
    m.frozen_until = ns{0};
    auto start = t;
    ns frozen_at = never, frozen_for{0};
    for (auto x = a; x < b; ++x) {
      auto k = ++started[m.d.node()];
      for (auto f : s.faults_at(who, k)) {
        s.fired[f] = true;
        auto& fault = s.faults[f];
        if (fault.kind == testing::step_fault::kill) {
          push(t, event::kill_node, id, who, "killed at its shard " + std::to_string(k));
          m.busy_until = never;
          return id;
        }
        if (fault.kind == testing::step_fault::slow) m.slow *= fault.value;
        if (fault.kind == testing::step_fault::freeze) {
          frozen_at = std::min(frozen_at, t);
          frozen_for += ns{static_cast<ns::rep>(fault.value)};
          t += ns{static_cast<ns::rep>(fault.value)};
        }
      }
      auto items = std::min(sums.n, (x + 1) * sums.ss) - x * sums.ss;
      auto cost = ns{static_cast<ns::rep>(static_cast<double>(s.cost.count()) *
                                          static_cast<double>(items) * m.slow)};
      t += ns{static_cast<ns::rep>(static_cast<double>(cost.count()) * j)};
    }
    m.busy_until = t;
    requests[id] = request{who, a, b, start, t};
    // Frozen past the heartbeats' limit: lost then (replica_timeout is the coordinator's).
    if (frozen_for >= s.idle_timeout)
      push(frozen_at + s.idle_timeout, event::lose_replica, id, who,
           "silent for limits::idle_timeout (frozen)");
    else
      push(t, event::answer, id, who, {});
    return id;
  }

  void take(std::uint64_t, const train_core::share& x) override {
    sums.take(*answer, x);
    s.note("answer [" + std::to_string(x.a) + "," + std::to_string(x.b) + ") from " +
           s.name(x.who));
  }

  /// A ring all-reduce among `members`: 1 ns per byte each member sends (2 (n - 1) / n of the
  /// gradient), its faults (in_ring) halfway through. Reduced when its first answer arrives
  /// with every member alive, with the arithmetic of the real ring (ring_schedule.hpp).
  std::vector<std::uint64_t> ring(const std::vector<std::size_t>& members, bool) override {
    ring_members = members;
    ring_attempt = sums.attempt;
    ring_reduced = false;
    const auto n = static_cast<double>(members.size());
    auto took = ns{static_cast<ns::rep>(2 * (n - 1) / n * static_cast<double>(s.grad_bytes))};
    s.note("ring all-reduce among " + std::to_string(members.size()) + " replicas");
    ns frozen{0};
    for (std::size_t f = 0; f < s.faults.size(); ++f) {
      auto& x = s.faults[f];
      if (s.fired[f] || !x.in_ring || x.step != s.steps || x.kind == testing::step_fault::slow)
        continue;
      for (auto who : members) {
        if (s.members[who].d.node() != x.node) continue;
        s.fired[f] = true;
        if (x.kind == testing::step_fault::kill) {
          push(s.now + took / 2, event::kill_node, 0, who, "killed in the ring all-reduce");
        } else {
          auto d = ns{static_cast<ns::rep>(x.value)};
          frozen += d;  // every member waits for the frozen one
          if (d >= s.idle_timeout)
            push(s.now + took / 2 + s.idle_timeout, event::lose_replica, 0, who,
                 "silent for limits::idle_timeout (frozen in the ring)");
        }
        break;
      }
    }
    std::vector<std::uint64_t> ids;
    for (auto who : members) {
      ids.push_back(s.next_id++);
      push(s.now + took + frozen, event::ring_answer, ids.back(), who, {});
    }
    return ids;
  }

  /// The ring's sum on every member, hop by hop as the ring's schedule says (ring_schedule.hpp,
  /// which ring_take and the data plane follow too), where the real ring leaves it
  /// (replica_state::ring).
  void reduce_ring() {
    const auto n = static_cast<std::uint32_t>(ring_members.size());
    std::vector<at::Tensor> parts;  // each member's own buffer, summed in place
    for (auto who : ring_members) {
      auto& st = *s.members[who].st;
      if (st.partial_step != sums.attempt || !st.partial.defined()) {  // no shard came to it
        st.partial = st.flat_buffer(&st.sum_buf).zero_();
        st.partial_step = st.buf_step = sums.attempt;
      }
      parts.push_back(st.partial);
    }
    const auto numel = parts[0].numel();
    const auto pieces =
        replica_state::ring_pieces(numel * static_cast<std::int64_t>(parts[0].element_size()), n);
    auto chunk = [&](std::uint32_t pos, std::uint32_t p, std::uint32_t k) {
      auto [b, e] = ring_plane::chunk_range(numel, pieces, n, p, k);
      return parts[pos].slice(0, b, e);
    };
    for (std::uint32_t p = 0; p < pieces; ++p)
      for (std::uint32_t h = 0; h < ring_plane::schedule{n, 0}.hops(); ++h) {
        std::vector<at::Tensor> sent(n);  // every member sends before anything of this hop lands
        for (std::uint32_t pos = 0; pos < n; ++pos)
          sent[pos] = chunk(pos, p, ring_plane::schedule{n, pos}.sent(h)).clone();
        for (std::uint32_t pos = 0; pos < n; ++pos) {
          const ring_plane::schedule right{n, (pos + 1) % n};
          auto into = chunk(right.pos, p, right.received(h));
          if (right.adds(h))
            into.add_(sent[pos]);
          else
            into.copy_(sent[pos]);
        }
      }
    for (auto who : ring_members) {
      auto& st = *s.members[who].st;
      st.ring = replica_state::ring_run{};
      st.ring.buf = st.partial;
      st.ring.n = n;
      st.ring.pieces = st.ring.done = pieces;
    }
    ring_reduced = true;
  }

  void reduce() override { sums.reduce(); }

  std::uint64_t apply(std::size_t who) override {
    auto id = s.next_id++;
    push(s.now, event::apply, id, who, {});
    return id;
  }

  void drop(std::size_t who, bool abandon) override {
    s.lose(who, abandon ? "no answer within replica_timeout" : "its step() threw");
  }

  void log(bool, const std::string& line) override { s.note(line); }

  void push(ns t, event::kind_t k, std::uint64_t id, std::size_t who, std::string why) {
    events.push({t, s.seq++, k, id, who, std::move(why)});
  }

  /// Runs the event that is due: an answer computed by the replica's code, an update applied,
  /// a replica or a node lost.
  void run(const event& e, train_core::train_coordinator& c) {
    auto& m = s.members[e.who];
    if (!m.alive) return;
    if (e.kind == event::kill_node || e.kind == event::lose_replica) {
      for (std::size_t i = 0; i < s.members.size(); ++i) {
        if (!s.members[i].alive) continue;
        if (e.kind == event::kill_node ? s.members[i].d.node() != m.d.node() : i != e.who) continue;
        s.lose(i, e.why);
        c.lost(i, s.now);
      }
      return;
    }
    train_msg out;
    bool ok = true;
    if (e.kind == event::ring_answer) {
      bool whole = ring_attempt == sums.attempt;  // not given up on for a new attempt
      for (auto who : ring_members) whole = whole && s.members[who].alive;
      if (whole && !ring_reduced) reduce_ring();
      return c.answered(e.id, true, 0, s.now);
    }
    if (e.kind == event::apply) {
      try {
        m.st->apply(sums.update_msg());
      } catch (const std::exception& ex) {
        ok = false;
        failures.emplace(e.id, std::make_pair(std::string{ex.what()}, std::uint64_t{0}));
      }
      return c.answered(e.id, ok, 0, s.now);
    }
    auto& r = requests[e.id];
    auto cmd = sums.backward(r.a, r.b, true);
    try {
      m.st->backward(cmd, out);
    } catch (const std::exception& ex) {
      ok = false;
      failures.emplace(e.id, std::make_pair(std::string{ex.what()}, m.st->failing_sample));
    }
    auto busy = std::chrono::duration<double>(r.done - r.started).count();
    if (ok) {
      m.rs.shards += r.b - r.a;
      m.rs.busy_seconds += busy;
    }
    answer = &out;
    c.answered(e.id, ok, busy, s.now);
    answer = nullptr;
  }

  impl& s;
  step_sums sums;
  train_msg* answer = nullptr;
  std::map<std::uint64_t, request> requests;
  std::vector<std::size_t> ring_members;  ///< the last ring's, in ring order
  std::uint64_t ring_attempt = 0;         ///< the attempt it reduces
  bool ring_reduced = false;
  std::map<std::string, std::size_t> started;  ///< shards each node began in this step
  std::priority_queue<event, std::vector<event>, std::greater<>> events;
  /// Failed answers by request: what the replica threw, and at which sample.
  std::map<std::uint64_t, std::pair<std::string, std::uint64_t>> failures;
};

double sim_trainer::impl::step(const batch& samples, bool local) {
  const std::uint64_t n = samples.size();
  if (n == 0) throw invalid_argument("step() needs a batch with at least one sample");
  if (coordinator.sync_before(local)) {
    auto live = alive();
    if (live.size() > 1) {
      auto state = bytes_tensor(members[live[0]].st->state());
      for (std::size_t k = 1; k < live.size(); ++k) members[live[k]].st->set_state(state);
    }
  }
  steps += 1;
  shell io{*this, samples};
  note(std::string{local ? "local step " : "step "} + std::to_string(steps) + ": " +
       std::to_string(n) + " samples, " + std::to_string(io.sums.shards) + " shards, " +
       std::to_string(alive().size()) + " replicas");
  train_core::train_coordinator::step_input in;
  in.samples = n;
  in.shard_size = o.shard_size;
  in.local = local;
  in.deterministic = o.deterministic;
  in.steps_done = stats.steps;
  in.grad_bytes = grad_bytes;
  // Replicas on simulated nodes: rings when the gradient is large enough (through CAF's path:
  // simulated nodes have no data port).
  std::vector<train_core::replica_info> infos;
  for (auto& m : members) infos.push_back(train_core::replica_info{m.alive, false, false, m.rate});
  coordinator.begin(in, std::move(infos), now, io);
  while (!coordinator.finished()) {
    auto due = coordinator.deadline();
    if (io.events.empty() && !due)
      throw protocol_error("internal: a simulated step with nothing to wait for");
    if (due && (io.events.empty() || *due < io.events.top().t)) {
      now = std::max(now, *due);
      coordinator.tick(now);
      continue;
    }
    auto e = io.events.top();
    io.events.pop();
    now = std::max(now, e.t);
    io.run(e, coordinator);
  }
  for (std::size_t i = 0; i < members.size(); ++i) members[i].rate = coordinator.replicas()[i].rate;
  stats.recomputed_shards += coordinator.step_counts().recomputed_shards;
  stats.ring_reductions += coordinator.step_counts().ring_reductions;
  auto& out = coordinator.result();
  throw_if_lost(out);
  using end = train_core::train_coordinator::end;
  if (out.e == end::backward_failed) {
    auto& [what, sample] = io.failures.at(out.id);
    throw work_error("replica::backward threw on " + name(out.who) + ": " + what, sample,
                     name(out.who));
  }
  // Faults at a shard the node did not reach in this step happen right after it.
  for (std::size_t f = 0; f < faults.size(); ++f) {
    if (fired[f] || faults[f].step != steps) continue;
    fired[f] = true;
    auto& x = faults[f];
    if (x.kind == testing::step_fault::kill) {
      lose_node(x.node, "killed after step " + std::to_string(steps));
    } else {
      auto d = ns{static_cast<ns::rep>(x.value)};
      if (x.kind == testing::step_fault::freeze && d >= idle_timeout) {
        // Silent past the heartbeats' limit before the next step has begun.
        lose_node(x.node, "silent for limits::idle_timeout (frozen after step " +
                              std::to_string(steps) + ")");
        continue;
      }
      for (auto& m : members) {
        if (m.d.node() != x.node) continue;
        if (x.kind == testing::step_fault::slow) m.slow *= x.value;
        if (x.kind == testing::step_fault::freeze) m.frozen_until = now + d;
      }
    }
  }
  if (out.e == end::apply_failed)
    throw apply_failed(name(out.who), io.failures.at(out.id).first, alive().empty());
  stats.steps += 1;
  stats.shards += io.sums.shards;
  auto mean = io.sums.mean_loss(coordinator.step_counts().lost_samples);
  std::ostringstream line;
  line << "step " << steps << " applied on " << alive().size() << " replicas, loss "
       << std::setprecision(6) << mean;
  note(line.str());
  return mean;
}

void sim_trainer::impl::average_parameters() {
  auto live = alive();
  if (live.empty()) throw node_error("no replica left: every one was lost or removed");
  std::vector<std::vector<at::Tensor>> each;
  for (auto i : live) each.push_back(members[i].st->params);
  auto mean = mean_parameters(each);
  for (auto i : live) members[i].st->set_params(mean);
  note("parameters averaged over " + std::to_string(live.size()) + " replicas");
}

}  // namespace troupe::detail
