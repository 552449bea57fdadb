// Simulated training (troupe/train_simulation.hpp): a discrete-event simulation of the
// coordinator's step on the calling thread. Shards are planned by train_core::split, recovered
// by train_core::ledger and summed as train_step.cpp sums them (the fixed tree, or partial sums
// in shard order); every replica is a real replica_state, so backward() and apply() are the
// code real replicas run. Virtual time: cost_per_item per sample, jitter per request, faults
// scripted with simulation::at_step or drawn by draw_training.
#include <algorithm>
#include <iomanip>
#include <optional>
#include <queue>
#include <random>
#include <sstream>

#include "train_replica.hpp"
#include "troupe/train_simulation.hpp"

namespace troupe::detail {
namespace {

using ns = std::chrono::nanoseconds;
constexpr ns never = ns::max();

}  // namespace

struct sim_trainer::impl {
  struct member {
    device d;  ///< the simulated device ("a:1/cpu")
    std::unique_ptr<replica_state> st;
    bool alive = true;
    double rate = 0;  ///< shards per virtual second, as measured
    ns busy_until{0};
    double slow = 1;
    ns frozen_until{0};  ///< a freeze carried into the next step
    replica_stats rs;
  };
  struct request {
    std::size_t who = 0;
    std::uint64_t a = 0, b = 0;
    ns started{0}, done{0};
  };
  struct event {
    ns t;
    std::uint64_t seq;
    /// An answer; a replica given up on (its own timeout); or its node killed (every replica on
    /// that node is lost with it).
    enum kind_t { answer, lose_replica, kill_node } kind;
    std::uint64_t id;
    std::size_t who;
    std::string why;
    bool operator>(const event& x) const { return t != x.t ? t > x.t : seq > x.seq; }
  };

  train_options o;
  std::vector<member> members;
  std::vector<testing::step_fault> faults;
  std::vector<bool> fired;
  std::mt19937_64 rng;
  ns cost{0}, now{0};
  double jitter = 0;
  ns idle_timeout = network_limits().idle_timeout;
  std::ostringstream log;
  train_stats stats;
  std::uint64_t steps = 0, next_id = 1, seq = 0;

  void note(const std::string& line) {
    log << std::fixed << std::setprecision(3) << std::setw(12)
        << std::chrono::duration<double, std::milli>(now).count() << " ms  " << line << "\n";
  }
  std::vector<std::size_t> alive() const {
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < members.size(); ++i)
      if (members[i].alive) out.push_back(i);
    return out;
  }
  std::string name(std::size_t who) const { return members[who].d.str(); }

  double step(const batch& samples);
  void lose_node(const std::string& node, const std::string& why);
  void lose(std::size_t who, const std::string& why);
  /// The faults of this step on `who`'s node that fire at its shard `k` (1-based).
  std::vector<std::size_t> faults_at(std::size_t who, std::size_t k) const {
    std::vector<std::size_t> out;
    for (std::size_t f = 0; f < faults.size(); ++f)
      if (!fired[f] && faults[f].step == steps && faults[f].node == members[who].d.node() &&
          faults[f].shard == k)
        out.push_back(f);
    return out;
  }
};

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

double sim_trainer::impl::step(const batch& samples) {
  const std::uint64_t n = samples.size();
  if (n == 0) throw invalid_argument("step() needs a batch with at least one sample");
  steps += 1;
  const std::uint64_t ss = o.shard_size;
  const std::uint64_t shards = (n + ss - 1) / ss;
  if (alive().empty()) throw node_error("no replica left: every one was lost or removed");
  const auto red = o.deterministic ? reduction::deterministic : reduction::fast;
  const auto attempt = next_id++;
  note("step " + std::to_string(steps) + ": " + std::to_string(n) + " samples, " +
       std::to_string(shards) + " shards, " + std::to_string(alive().size()) + " replicas");
  train_core::ledger book{shards, false};
  std::map<node_key, at::Tensor> blocks;
  std::map<std::uint64_t, at::Tensor> partials;
  std::vector<double> losses(shards, 0.0);
  std::map<std::uint64_t, request> requests;
  std::map<std::string, std::size_t> started;  // shards each node began in this step
  std::priority_queue<event, std::vector<event>, std::greater<>> events;
  auto shard_cost = [&](std::uint64_t s, const member& m) {
    auto k = std::min(n, (s + 1) * ss) - s * ss;
    return ns{
        static_cast<ns::rep>(static_cast<double>(cost.count()) * static_cast<double>(k) * m.slow)};
  };

  auto dispatch = [&](std::size_t who, std::uint64_t a, std::uint64_t b) {
    auto id = next_id++;
    book.sent(id, who, a, b);
    auto& m = members[who];
    note("send shards [" + std::to_string(a) + "," + std::to_string(b) + ") to " + name(who));
    const double j = 1 + jitter * std::uniform_real_distribution<double>(0, 1)(rng);
    auto t = std::max({now, m.busy_until, m.frozen_until});
    m.frozen_until = ns{0};
    auto start = t;
    ns frozen_at = never, frozen_for{0};
    for (auto s = a; s < b; ++s) {
      auto k = ++started[m.d.node()];
      for (auto f : faults_at(who, k)) {
        fired[f] = true;
        auto& x = faults[f];
        if (x.kind == testing::step_fault::kill) {
          events.push(
              {t, seq++, event::kill_node, id, who, "killed at its shard " + std::to_string(k)});
          m.busy_until = never;
          return;
        }
        if (x.kind == testing::step_fault::slow) m.slow *= x.value;
        if (x.kind == testing::step_fault::freeze) {
          frozen_at = std::min(frozen_at, t);
          frozen_for += ns{static_cast<ns::rep>(x.value)};
          t += ns{static_cast<ns::rep>(x.value)};
        }
      }
      t += ns{static_cast<ns::rep>(static_cast<double>(shard_cost(s, m).count()) * j)};
    }
    m.busy_until = t;
    requests[id] = request{who, a, b, start, t};
    // The coordinator's waits: replica_timeout from the request, heartbeats during a freeze.
    ns lost_at = never;
    std::string why;
    if (o.replica_timeout.count() > 0 && t - now > o.replica_timeout) {
      lost_at = now + o.replica_timeout;
      why = "no answer within replica_timeout";
    }
    if (frozen_for >= idle_timeout && frozen_at + idle_timeout < lost_at) {
      lost_at = frozen_at + idle_timeout;
      why = "silent for limits::idle_timeout (frozen)";
    }
    if (lost_at != never)
      events.push({lost_at, seq++, event::lose_replica, id, who, why});
    else
      events.push({t, seq++, event::answer, id, who, {}});
  };
  auto recompute = [&](const std::vector<train_core::range>& back) {
    if (back.empty()) return;
    auto rest = alive();
    if (rest.empty()) throw node_error("every replica was lost during the step");
    std::vector<double> rates;
    for (auto i : rest) rates.push_back(members[i].rate);
    for (auto [a, b] : back) {
      stats.recomputed_shards += b - a;
      note("recompute shards [" + std::to_string(a) + "," + std::to_string(b) + ")");
      for (auto& x : train_core::split(a, b, rest, rates, false)) dispatch(x.who, x.a, x.b);
    }
  };
  {
    auto live = alive();
    std::vector<double> rates;
    for (auto i : live) rates.push_back(members[i].rate);
    for (auto& x : train_core::split(0, shards, live, rates, false)) dispatch(x.who, x.a, x.b);
  }
  while (book.waiting()) {
    if (events.empty()) throw protocol_error("internal: a simulated step with nothing to wait for");
    auto e = events.top();
    events.pop();
    now = std::max(now, e.t);
    if (e.kind != event::answer) {
      if (!members[e.who].alive) continue;
      if (e.kind == event::kill_node)
        lose_node(members[e.who].d.node(), e.why);
      else
        lose(e.who, e.why);
      for (std::size_t i = 0; i < members.size(); ++i)
        if (!members[i].alive) recompute(book.lost(i));
      continue;
    }
    if (!members[e.who].alive) continue;
    auto x = book.answered(e.id);
    if (!x) {
      note("late answer from " + name(e.who) + " dropped");
      continue;
    }
    auto& m = members[e.who];
    auto& r = requests[e.id];
    train_msg cmd, out;
    cmd.code = static_cast<std::uint8_t>(op::backward);
    cmd.mode = static_cast<std::uint8_t>(red);
    cmd.step = attempt;
    cmd.total_shards = shards;
    cmd.first_shard = x->a;
    cmd.end_shard = x->b;
    cmd.shard_size = ss;
    cmd.samples = samples;
    cmd.first_sample = 0;
    try {
      m.st->backward(cmd, out);
    } catch (const std::exception& ex) {
      throw work_error("replica::backward threw on " + name(e.who) + ": " + ex.what(),
                       m.st->failing_sample, name(e.who));
    }
    auto busy = std::chrono::duration<double>(r.done - r.started).count();
    m.rs.shards += x->b - x->a;
    m.rs.busy_seconds += busy;
    if (busy > 0) {
      double rate = static_cast<double>(x->b - x->a) / busy;
      m.rate = m.rate > 0 ? 0.5 * m.rate + 0.5 * rate : rate;
    }
    for (auto s = x->a; s < x->b && s - x->a < out.losses.size(); ++s)
      losses[s] = out.losses[s - x->a];
    if (red == reduction::fast) {
      if (out.tensors.size() == 1) partials[x->a] = out.tensors[0];
    } else {
      for (std::size_t k = 0; k < out.tensors.size() && 2 * k + 1 < out.nodes.size(); ++k)
        blocks[{static_cast<int>(out.nodes[2 * k]), out.nodes[2 * k + 1]}] = out.tensors[k];
    }
    note("answer [" + std::to_string(x->a) + "," + std::to_string(x->b) + ") from " + name(e.who));
  }
  if (alive().empty()) throw node_error("every replica was lost during the step");
  require_whole(book);
  auto total = red == reduction::fast ? sum_partials(partials)
                                      : tree_combine(tree_top(shards), 0, shards, blocks);
  train_msg apply;
  apply.code = static_cast<std::uint8_t>(op::apply);
  apply.mode = static_cast<std::uint8_t>(red);
  apply.tensors.push_back(total);
  apply.divisor = static_cast<double>(n);
  // Every replica steps; one whose step() throws no longer matches the others: it is dropped
  // (as in data_parallel), and the step reports the first such failure once all have stepped.
  std::optional<work_error> apply_failure;
  for (auto i : alive()) {
    try {
      members[i].st->apply(apply);
    } catch (const std::exception& ex) {
      if (!apply_failure)
        apply_failure.emplace(
            "replica::step() threw on " + name(i) +
                " (that replica is dropped; the others have stepped): " + ex.what(),
            0, name(i));
      lose(i, "its step() threw");
    }
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
  if (apply_failure) throw *apply_failure;
  stats.steps += 1;
  stats.shards += shards;
  double sum = 0;
  for (auto l : losses) sum += l;
  std::ostringstream line;
  line << "step " << steps << " applied on " << alive().size() << " replicas, loss "
       << std::setprecision(6) << sum / static_cast<double>(n);
  note(line.str());
  return sum / static_cast<double>(n);
}

sim_trainer::sim_trainer(const testing::simulation& sim, std::vector<device> devices, config cfg,
                         train_options o, replica_maker make)
    : impl_(std::make_unique<impl>()) {
  auto& s = *impl_;
  if (devices.empty()) throw invalid_argument("data_parallel needs at least one device");
  if (o.shard_size == 0) throw invalid_argument("train_options::shard_size must be at least 1");
  s.o = o;
  s.rng.seed(sim.seed() ^ 0x747261696eULL);  // "train": its own stream of the seed
  s.cost = sim.item_cost();
  s.jitter = sim.jitter_factor();
  s.faults = sim.step_faults();
  s.fired.assign(s.faults.size(), false);
  auto names = sim.node_names();
  for (auto& d : devices) {
    if (std::find(names.begin(), names.end(), d.node()) == names.end())
      throw invalid_argument("simulated training: " + d.str() +
                             " is not a device of the simulation (sim.devices())");
    if (!d.is_cpu()) throw invalid_argument("simulated training runs replicas on CPUs: " + d.str());
  }
  // One at a time, replica 0 first (as data_parallel constructs them).
  for (auto& d : devices) {
    impl::member m;
    m.d = d;
    m.rs.device = d.str();
    m.st = std::make_unique<replica_state>();
    m.st->where = d.local();
    m.st->cfg = cfg;
    m.st->make = make;
    train_msg out;
    try {
      m.st->init(out);
    } catch (const error&) {
      throw;
    } catch (const std::exception& e) {
      throw init_error("replica constructor failed on " + d.str() + ": " + e.what());
    }
    s.members.push_back(std::move(m));
  }
  if (s.members.size() > 1) {
    auto state = bytes_tensor(s.members[0].st->state());
    for (std::size_t i = 1; i < s.members.size(); ++i) s.members[i].st->set_state(state);
  }
  s.note("started " + std::to_string(s.members.size()) + " replicas");
}

sim_trainer::sim_trainer(sim_trainer&&) noexcept = default;
sim_trainer& sim_trainer::operator=(sim_trainer&&) noexcept = default;
sim_trainer::~sim_trainer() {
  if (!impl_) return;
  for (auto& m : impl_->members) m.st->release();
}

double sim_trainer::step(const batch& samples) {
  return impl_->step(samples);
}

std::vector<at::Tensor> sim_trainer::parameters() {
  for (auto& m : impl_->members)
    if (m.alive) {
      std::vector<at::Tensor> out;
      for (auto& p : m.st->params) out.push_back(p.detach().clone());
      return out;
    }
  throw node_error("no replica left: every one was lost or removed");
}

std::vector<at::Tensor> sim_trainer::replica_parameters() {
  std::vector<at::Tensor> out;
  for (auto& m : impl_->members) {
    if (!m.alive) continue;
    std::vector<at::Tensor> flat;
    for (auto& p : m.st->params) flat.push_back(p.detach().reshape({-1}));
    out.push_back(at::cat(flat));
  }
  return out;
}

std::vector<device> sim_trainer::devices() const {
  std::vector<device> out;
  for (auto& m : impl_->members)
    if (m.alive) out.push_back(m.d);
  return out;
}

train_stats sim_trainer::stats() const {
  auto s = impl_->stats;
  for (auto& m : impl_->members) s.replicas.push_back(m.rs);
  return s;
}

std::string sim_trainer::trace() const {
  return impl_->log.str();
}

std::chrono::nanoseconds sim_trainer::now() const {
  return impl_->now;
}

}  // namespace troupe::detail

namespace troupe::testing {

void draw_training(simulation& sim, const explore_training_options& eo, std::size_t steps) {
  if (eo.nodes == 0) throw invalid_argument("explore_training_options: at least one node");
  std::vector<std::string> names;
  for (std::size_t i = 0; i < eo.nodes; ++i) names.push_back("n" + std::to_string(i) + ":1");
  sim.nodes(names, cpus(1));
  sim.cost_per_item(eo.cost_per_item);
  if (!eo.faults || steps == 0) return;
  std::mt19937_64 rng{sim.seed()};
  auto pick = [&](std::size_t n) {
    return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
  };
  auto order = names;
  std::shuffle(order.begin(), order.end(), rng);
  // Past the timeout: replica_timeout when set, else the heartbeats' idle_timeout.
  auto past = eo.opts.replica_timeout.count() > 0
                  ? std::chrono::nanoseconds{eo.opts.replica_timeout} * 2
                  : std::chrono::nanoseconds{network_limits().idle_timeout} * 2;
  auto losses = pick(eo.nodes);  // 0 .. nodes - 1: one node is never lost
  for (std::size_t i = 0; i < order.size(); ++i) {
    auto at = sim.at_step(1 + pick(steps)).at_shard(1 + pick(4));
    if (i < losses) {
      if (pick(2) == 0)
        at.kill(order[i]);
      else
        at.freeze(order[i], past);
    } else if (pick(3) == 0) {
      at.slow(order[i], 2.0 + static_cast<double>(pick(9)));
    }
  }
}

}  // namespace troupe::testing
