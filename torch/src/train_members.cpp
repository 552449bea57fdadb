// Data-parallel training, the coordinator's members (train_impl.hpp): starting replicas (here
// and on nodes), copying state to new ones, adding and removing devices, following a cluster.
#include <algorithm>

#include "train_impl.hpp"
#include "troupe/detail/network.hpp"
#include "troupe/internal/ask_node.hpp"

namespace troupe::detail {

std::vector<std::vector<std::size_t>> trainer::impl::construction_rounds(
    const std::vector<std::size_t>& fresh) {
  std::map<std::string, std::size_t> seen;  // process ("" = this one) -> replicas so far
  std::vector<std::vector<std::size_t>> rounds;
  for (auto i : fresh) {
    auto k = seen[members[i].d.is_local() ? std::string{} : members[i].d.node()]++;
    if (rounds.size() <= k) rounds.resize(k + 1);
    rounds[k].push_back(i);
  }
  return rounds;
}

std::vector<std::size_t> trainer::impl::start(const std::vector<device>& devices) {
  std::vector<std::size_t> fresh;
  for (auto& d : devices) {
    caf::actor a;
    if (d.is_local()) {
      if (auto why = why_unavailable(d); !why.empty()) throw device_unavailable(why);
      a = spawn_replica(*sys, d, cfg, make);
    } else {
      if (!networked)
        throw invalid_argument(
            "device " + d.str() +
            " is on a node, but this data_parallel was built over local devices only: name a "
            "node's device in the constructor's list to train over the network");
      if (job.empty())
        throw invalid_argument(
            "replicas on nodes need the job registered: TROUPE_REGISTER_JOB(...) in this program "
            "and the node's");
      // Watched: the node's death ends the wait at once (ask_node.hpp).
      a = spawn_on_node(*sys, nodes[d.node()], d.node(), tls_for(d.node()),
                        spawn_producer{job, signature, d.local().str(), cfg, members.size()}, owner,
                        deadlines, "replica");
    }
    (*self)->monitor(a);
    member m;
    m.d = d;
    m.a = a;
    m.st.device = d.str();
    members.push_back(std::move(m));
    fresh.push_back(members.size() - 1);
  }
  train_msg init;
  init.code = static_cast<std::uint8_t>(op::init);
  try {
    // The replicas' constructors run one at a time in each process, in member order (replica
    // 0 first): a constructor that seeds torch's global generator and builds its model
    // (torch::manual_seed(s); net = Net();) must not have its draws interleaved with another
    // replica's. Processes differ in their generators, so each round starts the next replica
    // of every process at once.
    for (auto& round : construction_rounds(fresh))
      for (auto& [who, msg] : everyone<init_reply>(round, init)) {
        grad_bytes = msg.grad_bytes;
        members[who].data_port = msg.data_port;
        members[who].carries_state = msg.carries_state;
      }
  } catch (...) {
    // The replicas that started are idle: freed before the exception leaves (the one that
    // failed too; one stuck past replica_timeout was given up on already).
    drop_idle(fresh);
    throw;
  }
  for (auto i : fresh) {
    if (members[i].alive) continue;
    auto why = "replica on " + members[i].d.str() + " was lost while starting";
    if (members[i].d.is_local()) throw node_error(why);
    throw node_start_failed(why, members[i].d.node());
  }
  return fresh;
}

void trainer::impl::copy_state(const std::vector<std::size_t>& to) {
  train_msg set;
  set.code = static_cast<std::uint8_t>(op::set_state);
  for (auto from : alive()) {
    if (std::find(to.begin(), to.end(), from) != to.end()) continue;
    train_msg get;
    get.code = static_cast<std::uint8_t>(op::get_state);
    auto got = everyone({from}, get);
    if (got.empty()) continue;  // lost meanwhile: the next one
    set.tensors = std::move(got.begin()->second.tensors);
    everyone(to, set);
    return;
  }
  if (held_state.defined()) {  // no replica holds the state: the one kept when the last left
    set.tensors.push_back(held_state);
    everyone(to, set);
    held_state = at::Tensor{};
  } else {
    refuse_if_state_gone();
  }
}

void trainer::impl::refuse_if_state_gone() {
  if (state_gone())
    throw node_error(
        "data_parallel: every replica was lost, and the training's parameters and optimizer "
        "state with them; the replicas added would start over from the constructors' model. "
        "load() a checkpoint first (with no replica, it is kept for the next ones added), or "
        "start a new data_parallel");
}

void trainer::impl::keep_state(std::size_t from) {
  train_msg get;
  get.code = static_cast<std::uint8_t>(op::get_state);
  try {
    auto got = everyone({from}, get);
    if (!got.empty()) held_state = std::move(got.begin()->second.tensors.at(0));
  } catch (const std::exception& e) {
    log(log_level::warn, std::string{"data_parallel: the last replica's state could not be "
                                     "kept as it was removed: "} +
                             e.what());
  }
}

void trainer::impl::add(const std::vector<device>& devices) {
  auto& p = *this;
  p.refuse_if_state_gone();  // before any replica is started
  auto fresh = p.start(devices);
  try {
    p.copy_state(fresh);
  } catch (...) {
    // The new replicas did not get the others' state: they leave before the exception does.
    p.drop_idle(fresh);
    throw;
  }
  p.note_fresh_state(fresh);
}

void trainer::impl::note_fresh_state(const std::vector<std::size_t>& fresh) {
  std::size_t n = 0;
  for (auto i : fresh)
    if (!members[i].carries_state) ++n;
  if (n == 0) return;
  stats.fresh_state_joins += n;
  if (warned_fresh_state) return;
  warned_fresh_state = true;
  log(log_level::warn,
      "data_parallel: a replica joined a run (" + members[fresh[0]].d.str() +
          ") but its optimizer's state cannot follow it: the replica type has neither "
          "`torch::optim::Optimizer& optimizer()` nor save/load, so its optimizer starts fresh "
          "(momentum, Adam's moments and step counts empty) and, with such an optimizer, its "
          "updates differ from the others'. Add `torch::optim::Optimizer& optimizer() { return "
          "opt; }` to the replica "
          "(train_stats::fresh_state_joins counts such joins)");
}

void trainer::impl::remove(const std::vector<device>& devices) {
  auto& p = *this;
  std::vector<std::size_t> removed;
  std::string missing;
  for (auto& d : devices) {
    auto i = std::find_if(p.members.begin(), p.members.end(), [&](const member& m) {
      return m.alive && m.d == d &&
             std::find(removed.begin(), removed.end(),
                       static_cast<std::size_t>(&m - p.members.data())) == removed.end();
    });
    if (i == p.members.end()) {
      missing = d.str();
      break;
    }
    removed.push_back(static_cast<std::size_t>(i - p.members.begin()));
  }
  // The last replicas leave: their state is kept for the next ones added (else add_devices
  // started over from the constructors' model, silently).
  if (!removed.empty() && removed.size() == p.alive().size()) p.keep_state(removed[0]);
  for (auto i : removed) {
    p.members[i].alive = false;
    (*p.self)->demonitor(p.members[i].a);
  }
  p.retire(removed);  // between steps: idle, so a local one frees its tensors at once
  if (!missing.empty()) throw invalid_argument("no replica on " + missing + " to remove");
}

void trainer::impl::follow_change(const membership_event& e) {
  std::lock_guard<std::recursive_mutex> guard{calls};
  struct publish_after {  // the replicas it added, removed or dropped show at once
    impl& p;
    ~publish_after() { p.publish(); }
  } after{*this};
  auto on_node = [&] {
    std::vector<device> there;
    for (auto& m : members)
      if (m.alive && !m.d.is_local() && m.d.node() == e.node) there.push_back(m.d);
    return there;
  };
  switch (e.what) {
    case membership_event::joined:
    case membership_event::rejoined: {
      nodes.erase(e.node);  // a restarted node is another process: connect anew
      if (e.what == membership_event::rejoined)  // the old process's replicas are gone
        for (std::size_t i = 0; i < members.size(); ++i)
          if (members[i].alive && !members[i].d.is_local() && members[i].d.node() == e.node)
            drop(i);
      auto here = on_node();
      std::vector<device> fresh;
      for (auto& d : e.devices) {
        auto i = std::find(here.begin(), here.end(), d);
        if (i != here.end())
          here.erase(i);
        else
          fresh.push_back(d);
      }
      if (!fresh.empty()) add(fresh);
      return;
    }
    case membership_event::draining: {
      auto there = on_node();
      if (!there.empty()) remove(there);
      return;
    }
    case membership_event::lost:
      // Given up on by the cluster: its replicas are lost now (the next step does not wait for
      // them), whatever they answer later is not used.
      nodes.erase(e.node);
      for (std::size_t i = 0; i < members.size(); ++i)
        if (members[i].alive && !members[i].d.is_local() && members[i].d.node() == e.node) drop(i);
      return;
    case membership_event::drained:
      return;
  }
}

bool trainer::impl::only_on(const std::string& node) {
  std::lock_guard<std::recursive_mutex> guard{calls};
  bool any = false;
  for (auto& m : members) {
    if (!m.alive) continue;
    if (m.d.is_local() || m.d.node() != node) return false;
    any = true;
  }
  return any;
}

}  // namespace troupe::detail
