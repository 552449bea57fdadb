// Simulated training (troupe/train_simulation.hpp): the simulated coordinator's construction,
// accessors, and draw_training. Its step: train_sim_step.cpp.
#include <algorithm>
#include <random>

#include "train_sim_impl.hpp"

namespace troupe::detail {

sim_trainer::sim_trainer(const testing::simulation& sim, std::vector<device> devices, config cfg,
                         train_options o, replica_maker make)
    : impl_(std::make_unique<impl>()) {
  auto& s = *impl_;
  if (devices.empty()) throw invalid_argument("data_parallel needs at least one device");
  if (o.shard_size == 0) throw invalid_argument("train_options::shard_size must be at least 1");
  s.o = o;
  s.coordinator = train_core::train_coordinator{train_core::train_coordinator::options{
      std::chrono::duration_cast<sim_ns>(o.replica_timeout), false}};
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
    init_reply out;
    try {
      m.st->init(out);
      s.grad_bytes = out.grad_bytes;
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

double sim_trainer::step(const batch& samples, bool local) {
  return impl_->step(samples, local);
}

void sim_trainer::average_parameters() {
  impl_->average_parameters();
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
  for (std::size_t i = 0; i < eo.nodes; ++i) {
    std::string name = "n";  // (GCC 12 warns falsely, -Wrestrict, on "n" + to_string(i))
    name += std::to_string(i);
    name += ":1";
    names.push_back(std::move(name));
  }
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
