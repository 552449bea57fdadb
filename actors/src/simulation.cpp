// troupe::testing::simulation: runners on simulated nodes, in virtual time, on the calling
// thread. The actor system runs on CAF's test coordinator (one thread, a virtual clock): the
// real scheduler actor and the real consumer actors run there unchanged, and each simulated
// producer runs the job's real producer code, then answers after the chunk's virtual cost.
// Which of the actors ready at one virtual moment runs next, and each chunk's jitter, come from
// the seed, so one seed gives one trace.
#include "troupe/simulation.hpp"

#include <algorithm>

#include "sim_access.hpp"
#include "sim_state.hpp"

namespace troupe::testing {

using detail::sim_of;

void fault_at::add(int kind, const std::string& node, double value) {
  auto& s = sim_of(host_);
  s.node(node);  // throws for an unknown node
  if (chunk_ > 0) {
    s.chunk_faults_.push_back(detail::sim_chunk_fault{node, chunk_, kind, value});
    return;
  }
  auto* sp = &s;
  s.at(after_, [sp, kind, node, value] { sp->apply(kind, node, value); });
}

void fault_at::kill(const std::string& node) {
  add(detail::kill_fault, node, 0);
}
void fault_at::drain(const std::string& node) {
  add(detail::drain_fault, node, 0);
}
void fault_at::freeze(const std::string& node, std::chrono::nanoseconds d) {
  if (d.count() < 0 || d > std::chrono::hours{24 * 365})
    throw invalid_argument("simulation: freeze() needs a duration between 0 and a year");
  add(detail::freeze_fault, node, static_cast<double>(d.count()));
}
void fault_at::slow(const std::string& node, double factor) {
  if (!(factor > 0) || factor > 1e6)
    throw invalid_argument("simulation: slow() needs a factor above 0 and at most 1e6");
  add(detail::slow_fault, node, factor);
}
void fault_at::partition(const std::string& node) {
  add(detail::partition_fault, node, 0);
}
void fault_at::heal(const std::string& node) {
  add(detail::heal_fault, node, 0);
}
void fault_at::delay(const std::string& node, std::chrono::nanoseconds d) {
  if (d.count() < 0 || d > std::chrono::hours{1})
    throw invalid_argument("simulation: delay() needs a duration between 0 and 1 hour");
  add(detail::delay_fault, node, static_cast<double>(d.count()));
}

void producer_script::throws_at_item(std::uint64_t item) {
  sim_of(host_).throws_[index_].push_back(item);
}

step_fault_at step_fault_at::at_shard(std::size_t n) const {
  if (n == 0) throw invalid_argument("simulation: at_shard counts from 1");
  return step_fault_at{to_, nodes_, step_, n};
}

step_fault_at step_fault_at::in_ring() const {
  return step_fault_at{to_, nodes_, step_, 0, true};
}

void step_fault_at::add(step_fault::kind_t kind, const std::string& node, double value) {
  if (std::find(nodes_.begin(), nodes_.end(), node) == nodes_.end())
    throw invalid_argument("simulation: no node \"" + node + "\"");
  to_->push_back(step_fault{step_, shard_, kind, node, value, ring_});
}

void step_fault_at::kill(const std::string& node) {
  add(step_fault::kill, node, 0);
}

void step_fault_at::freeze(const std::string& node, std::chrono::nanoseconds d) {
  if (d.count() < 0 || d > std::chrono::hours{24 * 365})
    throw invalid_argument("simulation: freeze() needs a duration between 0 and a year");
  add(step_fault::freeze, node, static_cast<double>(d.count()));
}

void step_fault_at::slow(const std::string& node, double factor) {
  if (!(factor > 0) || factor > 1e6)
    throw invalid_argument("simulation: slow() needs a factor above 0 and at most 1e6");
  add(step_fault::slow, node, factor);
}

step_fault_at simulation::at_step(std::size_t k) {
  if (k == 0) throw invalid_argument("simulation::at_step counts from 1");
  return step_fault_at{step_faults_, node_names(), k, 1};
}

std::uint64_t simulation::seed() const {
  return seed_;
}

const std::vector<step_fault>& simulation::step_faults() const {
  return *step_faults_;
}

std::vector<std::string> simulation::node_names() const {
  std::vector<std::string> out;
  for (auto& d : sim_of(host_).devices_)
    if (std::find(out.begin(), out.end(), d.node()) == out.end()) out.push_back(d.node());
  return out;
}

std::chrono::nanoseconds simulation::item_cost() const {
  return sim_of(host_).cost_;
}

double simulation::jitter_factor() const {
  return sim_of(host_).jitter_;
}

simulation::simulation(std::uint64_t seed) : seed_(seed) {
  auto s = std::make_shared<detail::sim_state>(seed);
  s->self_ = s;
  host_ = std::move(s);
}

simulation::~simulation() = default;

void simulation::nodes(const std::vector<std::string>& names, const std::vector<device>& per_node) {
  auto& s = sim_of(host_);
  for (auto& name : names) {
    device probe{name + "/cpu"};  // throws invalid_argument for a malformed name
    if (probe.node() != name)
      throw invalid_argument("simulation: \"" + name + "\" is not a node name (HOST:PORT)");
    s.add_node(name);
    for (auto& d : per_node) {
      if (!d.is_local())
        throw invalid_argument("simulation::nodes: per-node devices are local ones (\"cpu\")");
      s.devices_.emplace_back(name + "/" + d.str());
    }
  }
}

std::vector<device> simulation::devices() const {
  return sim_of(host_).devices_;
}

void simulation::cost_per_item(std::chrono::nanoseconds d) {
  if (d.count() < 0 || d > std::chrono::hours{1})
    throw invalid_argument("simulation: cost_per_item must be between 0 and 1 hour");
  sim_of(host_).cost_ = d;
}

void simulation::jitter(double j) {
  if (!(j >= 0) || j > 1000)
    throw invalid_argument("simulation: jitter must be between 0 and 1000");
  sim_of(host_).jitter_ = j;
}

void simulation::time_limit(std::chrono::nanoseconds d) {
  if (d.count() < 0) throw invalid_argument("simulation: time_limit must not be negative");
  sim_of(host_).limit_ = d;
}

void simulation::livelock_after(std::size_t events) {
  if (events == 0) throw invalid_argument("simulation: livelock_after must be at least 1");
  sim_of(host_).livelock_after() = events;
}

fault_at simulation::at_chunk(std::size_t n) {
  if (n == 0) throw invalid_argument("simulation::at_chunk counts from 1");
  return fault_at{host_, n, std::chrono::nanoseconds{0}};
}

fault_at simulation::after(std::chrono::nanoseconds d) {
  if (d.count() < 0 || d > std::chrono::hours{24 * 365})
    throw invalid_argument("simulation: after() needs a duration between 0 and a year");
  return fault_at{host_, 0, d};
}

producer_script simulation::producer(std::size_t index) {
  return producer_script{host_, index};
}

bool simulation::run_until_idle() {
  return sim_of(host_).run_until_idle();
}

std::string simulation::trace() const {
  return sim_of(host_).trace();
}

std::chrono::nanoseconds simulation::now() const {
  return sim_of(host_).elapsed();
}

simulation::scheduler_cost simulation::scheduler_time() const {
  return sim_of(host_).scheduler_time();
}

void simulation::draw(const explore_options& eo) {
  auto& s = sim_of(host_);
  if (eo.nodes == 0 || eo.producers_per_node == 0)
    throw invalid_argument("explore_options: at least one node and one producer per node");
  std::vector<std::string> names;
  for (std::size_t i = 0; i < eo.nodes; ++i) names.push_back("n" + std::to_string(i) + ":1");
  nodes(names, cpus(eo.producers_per_node));
  cost_per_item(eo.cost_per_item);
  if (!eo.faults) return;
  auto& rng = s.rng_;
  auto pick = [&](std::size_t n) {
    return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
  };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  // Losses (kills, long freezes, partitions) leave at least one node. Drains are drawn from a
  // copy of the generator, so that the schedules of the seeds before drains existed (and the
  // seeds quoted in tests) stay what they were.
  auto side = rng;
  side.discard(4096);
  std::vector<std::string> order = names;
  std::shuffle(order.begin(), order.end(), rng);
  auto losses = pick(eo.nodes);  // 0 .. nodes - 1
  for (std::size_t i = 0; i < losses; ++i) {
    auto& node = order[i];
    switch (pick(3)) {
      case 0:
        at_chunk(1 + pick(4)).kill(node);
        break;
      case 1:
        after(std::chrono::microseconds{pick(20'000)}).freeze(node, std::chrono::seconds{2});
        break;
      default:
        after(std::chrono::microseconds{pick(20'000)}).partition(node);
        break;
    }
  }
  if (order.size() - losses >= 2 && std::uniform_real_distribution<double>(0, 1)(side) < 0.25) {
    // A graceful leave (SIGTERM) of one of the nodes not lost; one undrained node remains.
    auto& node = order[losses];
    at_chunk(1 + std::uniform_int_distribution<std::size_t>(0, 3)(side)).drain(node);
  }
  for (std::size_t i = losses; i < order.size(); ++i) {
    auto& node = order[i];
    if (chance(0.3))
      after(std::chrono::microseconds{pick(20'000)})
          .freeze(node, std::chrono::microseconds{1 + pick(1'000'000)});
    if (chance(0.3))
      after(std::chrono::microseconds{pick(20'000)}).slow(node, 2.0 + static_cast<double>(pick(9)));
    if (chance(0.3))
      after(std::chrono::microseconds{pick(20'000)})
          .delay(node, std::chrono::microseconds{pick(5'000)});
  }
}

}  // namespace troupe::testing

namespace troupe::detail {

void sim_access::plant(testing::simulation& sim, planted_bug b) {
  sim_of(sim.host_).plant(b);
}

}  // namespace troupe::detail
