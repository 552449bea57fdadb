// Data-parallel training, the coordinator's step (train_impl.hpp): shards split among the
// replicas, lost shards recomputed, gradients reduced (by the coordinator, a fixed tree or a
// ring among the replicas) and the update applied everywhere.
#include <algorithm>

#include "ring_plane.hpp"
#include "train_impl.hpp"
#include "troupe/detail/network.hpp"

namespace troupe::detail {
namespace {

double seconds(clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

bool trainer::impl::use_ring(const std::vector<std::size_t>& live) const {
  bool remote = false;
  for (auto i : live) remote = remote || !members[i].d.is_local();
  return transport.ring(stats.steps, live.size(), grad_bytes, remote);
}

train_core::transport_policy::ring_end trainer::impl::ring_all_reduce(std::uint64_t attempt) {
  using ring_end = train_core::transport_policy::ring_end;
  auto ring = alive();
  if (ring.size() < 2) return ring_end::lost;
  auto id = next_id++;
  // The data plane when every member has a port (CPU replicas on nodes served without TLS).
  bool ports = true;
  for (auto i : ring) ports = ports && !members[i].d.is_local() && members[i].data_port != 0;
  bool plane = transport.plane(o.direct_ring, ports);
  auto key = plane ? ring_plane::to_hex(ring_plane::random_key()) : std::string{};
  std::map<std::uint64_t, pending> waiting;
  for (std::size_t k = 0; k < ring.size(); ++k) {
    auto& me = members[ring[k]];
    auto& right = members[ring[(k + 1) % ring.size()]];
    std::string address;  // a node-to-node hop needs a direct connection
    if (!plane && !me.d.is_local() && !right.d.is_local() && me.d.node() != right.d.node())
      address = right.d.node();
    std::string data;
    if (plane) {
      auto host = parse_host_port(right.d.node()).host;
      if (host.find(':') != std::string::npos) host = "[" + host + "]";
      data = host + ":" + std::to_string(right.data_port);
    }
    auto reply = next_id++;
    (*self)->send(me.a, ring_atom::value, reply, id, attempt, static_cast<std::uint32_t>(k),
                  static_cast<std::uint32_t>(ring.size()), right.a, address, data, key);
    waiting[reply] = pending{ring[k], clock::now(), 0, 0};
  }
  bool ok = true, lost = false, plane_failed = false, timed_out = false;
  wait(
      waiting,
      [&](const pending&, chunk_result& r, train_msg&) {
        if (r.ok()) return;
        ok = false;
        waiting.clear();  // the others wait for chunks that will not come: give up on them
        if (plane) {
          // Most often a neighbour lost (its connection closed before the coordinator heard
          // of it): the step's recomputation tells (see step()).
          plane_failed = true;
          log(log_level::info, r.what + "; reducing this step through the coordinator");
        } else {
          log(log_level::warn, r.what + "; reducing through the coordinator from now on");
        }
      },
      [&](const pending&) {
        ok = false;
        lost = true;
        waiting.clear();
      },
      [&] {
        // replica_timeout inside the ring: every member's answer waits for the whole ring,
        // so lateness names no one. The step is computed again through the coordinator,
        // where a frozen replica's own request times out and only it is dropped.
        ok = false;
        timed_out = true;
        waiting.clear();
        log(log_level::warn,
            "ring all-reduce past replica_timeout; reducing this step "
            "through the coordinator");
      });
  if (ok) {
    stats.ring_reductions += 1;
    if (plane) stats.direct_ring_reductions += 1;
    return ring_end::done;
  }
  if (lost) return ring_end::lost;
  if (timed_out) return ring_end::timed_out;
  return plane_failed ? ring_end::plane_failed : ring_end::failed;
}

std::vector<std::pair<std::size_t, std::pair<std::uint64_t, std::uint64_t>>> trainer::impl::split(
    std::uint64_t a, std::uint64_t b, const std::vector<std::size_t>& who, bool even) {
  std::vector<double> rates;
  for (auto i : who) rates.push_back(members[i].rate);
  std::vector<std::pair<std::size_t, std::pair<std::uint64_t, std::uint64_t>>> out;
  for (auto& x : train_core::split(a, b, who, rates, even)) out.push_back({x.who, {x.a, x.b}});
  return out;
}

double trainer::impl::step(const batch& samples, mode m) {
  auto started = clock::now();
  const std::uint64_t n = samples.size();
  if (n == 0) throw invalid_argument("step() needs a batch with at least one sample");
  const std::uint64_t ss = o.shard_size;
  const std::uint64_t shards = (n + ss - 1) / ss;
  if (m == mode::local) {
    states_differ = true;
  } else if (states_differ) {
    auto live = alive();
    if (live.size() > 1) copy_state(std::vector<std::size_t>(live.begin() + 1, live.end()));
    states_differ = false;
  }
  auto red = m == mode::local ? reduction::local
                              : (o.deterministic ? reduction::deterministic : reduction::fast);
  auto live = alive();
  if (live.empty()) throw node_error("no replica left: every one was lost or removed");
  if (red == reduction::fast && use_ring(live)) red = reduction::ring;
  std::vector<double> losses(shards, 0.0);
  std::map<std::uint64_t, at::Tensor> partials;  // fast: by first shard
  std::map<node_key, at::Tensor> blocks;         // deterministic
  std::map<std::uint64_t, pending> waiting;
  train_core::ledger book;           // where each shard is counted (train_core.hpp)
  std::vector<std::size_t> stepped;  // local: who holds a gradient
  std::uint64_t lost_samples = 0;    // local: of replicas lost with their update
  std::uint64_t attempt = next_id++;

  auto dispatch = [&](std::size_t who, std::uint64_t a, std::uint64_t b) {
    train_msg msg;
    msg.code = static_cast<std::uint8_t>(op::backward);
    msg.mode = static_cast<std::uint8_t>(red);
    msg.step = attempt;
    msg.total_shards = shards;
    msg.first_shard = a;
    msg.end_shard = b;
    msg.shard_size = ss;
    auto from = a * ss, to = std::min(n, b * ss);
    if (members[who].d.is_local()) {  // shared, not copied
      msg.samples = samples;
      msg.first_sample = 0;
    } else {
      msg.samples = samples.slice(from, to);
      msg.first_sample = from;
    }
    auto id = send(who, std::move(msg));
    waiting[id] = pending{who, clock::now(), a, b};
    book.sent(id, who, a, b);
  };
  first_failure failure;
  // Shards given back by a lost replica (in flight, or in ring mode summed on it): computed
  // again by the survivors, in the same step.
  auto recompute = [&](const std::vector<train_core::range>& ranges) {
    auto rest = alive();
    if (rest.empty()) return;
    for (auto [a, b] : ranges) {
      stats.recomputed_shards += b - a;
      for (auto& [to, range] : split(a, b, rest, false)) dispatch(to, range.first, range.second);
    }
  };
  auto wait_backward = [&] {
    wait(
        waiting,
        [&](const pending& p, chunk_result& r, train_msg& msg) {
          if (failure.failed(p, r)) {
            book.failed(r.run);
            return;
          }
          if (!book.answered(r.run)) return;  // a request given up on
          auto& mem = members[p.member];
          mem.st.shards += p.b - p.a;
          mem.st.busy_seconds += static_cast<double>(msg.busy_ns) * 1e-9;
          if (msg.busy_ns > 0) {
            double rate =
                static_cast<double>(p.b - p.a) / (static_cast<double>(msg.busy_ns) * 1e-9);
            mem.rate = mem.rate > 0 ? 0.5 * mem.rate + 0.5 * rate : rate;
          }
          for (std::uint64_t s = p.a; s < p.b && s - p.a < msg.losses.size(); ++s)
            losses[s] = msg.losses[s - p.a];
          if (red == reduction::fast) {
            if (msg.tensors.size() == 1) partials[p.a] = msg.tensors[0];
          } else if (red == reduction::deterministic) {
            for (std::size_t k = 0; k < msg.tensors.size() && 2 * k + 1 < msg.nodes.size(); ++k)
              blocks[{static_cast<int>(msg.nodes[2 * k]), msg.nodes[2 * k + 1]}] = msg.tensors[k];
          } else if (red == reduction::local) {
            stepped.push_back(p.member);
          }
        },
        [&](const pending& p) {
          if (failure.result) return;
          auto back = book.lost(p.member);
          if (red != reduction::local) return recompute(back);
          // That replica's own update is gone with it: its samples (the last shard may be
          // short) leave the mean loss.
          for (auto [a, b] : back) lost_samples += std::min(b * ss, n) - a * ss;
        });
  };
  auto compute = [&] {
    book = train_core::ledger{shards, red == reduction::ring};
    for (auto& [who, range] : split(0, shards, alive(), red == reduction::local))
      dispatch(who, range.first, range.second);
    // A replica that answered and was lost before the others did took its sum along (ring
    // mode): its shards go to the survivors, in the same step, until no such loss is left.
    for (bool again = true; again;) {
      again = false;
      wait_backward();
      if (failure.result) raise(*failure.result, failure.member);
      if (alive().empty()) break;
      for (auto who : book.holders())
        if (!members[who].alive) {
          recompute(book.lost(who));
          again = true;
        }
    }
    if (alive().empty()) throw node_error("every replica was lost during the step");
    if (red != reduction::local) require_whole(book);
  };
  compute();
  using ring_end = train_core::transport_policy::ring_end;
  using decision = train_core::transport_policy::decision;
  auto ring_start = clock::now();
  auto ring = red == reduction::ring ? ring_all_reduce(attempt) : ring_end::done;
  if (red == reduction::ring) stats.reduce_seconds += seconds(clock::now() - ring_start);
  if (red == reduction::ring && ring == ring_end::done) transport.ended(ring, stats.steps);
  if (red == reduction::ring && ring != ring_end::done) {
    // A replica lost (or failing, or late) inside the ring: the partial sums are half
    // reduced. The whole step again, on the survivors, summed by the coordinator.
    red = reduction::fast;
    attempt = next_id++;
    std::fill(losses.begin(), losses.end(), 0.0);
    stats.recomputed_shards += shards;
    auto lost_before = stats.lost_replicas;
    auto pause = transport.next_pause();
    compute();
    switch (transport.ended(ring, stats.steps, stats.lost_replicas != lost_before)) {
      case decision::paused:  // a ring too slow although every replica answers on its own
        log(log_level::warn,
            "the next " + std::to_string(pause) + " steps reduce through the coordinator");
        break;
      case decision::plane_off:  // a data port the others cannot reach, say
        log(log_level::warn,
            "a ring over the replicas' data ports failed while every replica answered; rings "
            "go through CAF from now on");
        break;
      default:
        break;
    }
  }

  auto reduce_start = clock::now();
  train_msg apply;
  apply.code = static_cast<std::uint8_t>(op::apply);
  apply.mode = static_cast<std::uint8_t>(red);
  std::vector<std::size_t> targets;
  if (red == reduction::local) {
    targets = stepped;
  } else if (red == reduction::ring) {
    apply.divisor = static_cast<double>(n);  // every replica holds the sum already
    targets = alive();
  } else {
    auto total = red == reduction::fast ? sum_partials(partials)
                                        : tree_combine(tree_top(shards), 0, shards, blocks);
    apply.tensors.push_back(total);
    apply.divisor = static_cast<double>(n);
    targets = alive();
  }
  std::optional<std::pair<chunk_result, std::size_t>> apply_failure;
  std::map<std::uint64_t, pending> applying;
  for (auto w : targets)
    if (members[w].alive) applying[send(w, apply)] = pending{w, clock::now(), 0, 0};
  wait(
      applying,
      [&](const pending& p, chunk_result& r, train_msg&) {
        if (r.ok()) return;
        // This replica's step() threw after others applied theirs: it no longer matches them.
        if (!apply_failure) apply_failure.emplace(r, p.member);
        drop(p.member, /*abandon=*/false);  // idle: retired with the others
      },
      [](const pending&) {});
  auto done = clock::now();
  stats.reduce_seconds += seconds(done - reduce_start);
  if (apply_failure) {
    auto& [r, who] = *apply_failure;
    throw work_error("replica::step() threw on " + members[who].d.str() +
                         " (that replica is dropped; the others have stepped): " + r.what,
                     0, members[who].d.str());
  }
  stats.steps += 1;
  stats.shards += shards;
  stats.step_seconds += seconds(done - started);
  double sum = 0;
  for (auto l : losses) sum += l;
  auto counted = n > lost_samples ? n - lost_samples : 1;
  return sum / static_cast<double>(counted);
}

}  // namespace troupe::detail
