// Data-parallel training: replica actors (one thread each, on its device) and the coordinator
// that assigns shards, reduces gradients once, applies the same update everywhere, and
// recomputes a lost replica's shards on the survivors. Design notes: docs/api.md, "Training:
// data_parallel".
//
// Replicas speak the runner's producer protocol (work_chunk in, chunk_result out), with one
// train_msg as the chunk's only item: nodes spawn them through spawn_producer like any job's
// producer, and large tensors cross the network through the bulk path.
//
// This file: trainer's public functions. The parts: train_msg.hpp (shared), train_replica*.cpp
// (the replica actor), train_impl.hpp and train_requests/step/members.cpp (the coordinator).
#include "troupe/train.hpp"

#include <atomic>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <fstream>
#include <iterator>

#include "train_impl.hpp"
#include "troupe/detail/network.hpp"
#include "troupe/internal/ask_node.hpp"

namespace troupe::detail {
namespace {

/// The actor system of every data_parallel over local devices only. Never destroyed (like the
/// runners' local system): a replica stuck inside backward() is left behind when its
/// data_parallel goes, instead of blocking that destructor until backward() returns.
caf::actor_system& training_system() {
  static caf::actor_system* sys = [] {
    auto* cfg = make_system_config(false).release();  // lives as long as the system: forever
    return new caf::actor_system(*cfg);
  }();
  return *sys;
}

}  // namespace

void trainer::impl::publish() noexcept try {
  if (!numbers) {
    static std::atomic<std::uint64_t> next_id{1};
    auto n = std::make_shared<published<trainer_view>>();
    n->view.id = next_id++;
    trainers().add(n);
    numbers = std::move(n);
  }
  auto replicas = alive().size();
  std::lock_guard<std::mutex> guard{numbers->mtx};
  auto& v = numbers->view;
  v.steps = stats.steps;
  v.shards = stats.shards;
  v.recomputed_shards = stats.recomputed_shards;
  v.lost_replicas = stats.lost_replicas;
  v.ring_reductions = stats.ring_reductions;
  v.reduce_seconds = stats.reduce_seconds;
  v.step_seconds = stats.step_seconds;
  v.replicas = replicas;
} catch (...) {  // out of memory: observers keep the last numbers
}

trainer::trainer(std::vector<device> devices, config cfg, train_options o, std::string job,
                 replica_maker make, std::string signature)
    : impl_(std::make_unique<impl>()) {
  if (devices.empty()) throw invalid_argument("data_parallel needs at least one device");
  if (o.shard_size == 0) throw invalid_argument("train_options::shard_size must be at least 1");
  if (o.replica_timeout.count() < 0)
    throw invalid_argument("train_options::replica_timeout must not be negative");
  auto& p = *impl_;
  p.cfg = std::move(cfg);
  p.o = o;
  p.job = std::move(job);
  p.make = make;
  p.signature = std::move(signature);
  std::string remote;
  for (auto& d : devices)
    if (!d.is_local()) remote = d.node();
  if (remote.empty()) {
    p.sys = &training_system();
  } else {
    p.networked = true;
    p.sys = &network_system(tls_for(remote));
  }
  p.self = std::make_unique<caf::scoped_actor>(*p.sys);
  // An argument, however useless: a spawn without one makes CAF 0.17.6 dereference a null
  // std::shared_ptr<std::tuple<>> (UBSan reports it).
  p.owner = p.sys->spawn(
      [](caf::event_based_actor*, bool) -> caf::behavior {
        // A draining node's notice (leaving_atom): its replicas are lost to this trainer when
        // the node stops, and recomputed as for any loss.
        return {[](std::uint8_t) {}, [](leaving_atom, const std::vector<caf::actor>&) {}};
      },
      true);
  auto fresh = p.start(devices);
  p.copy_state(std::vector<std::size_t>(fresh.begin() + 1, fresh.end()));
  p.publish();
}

trainer::trainer(const cluster& c, config cfg, train_options o, std::string job, replica_maker make,
                 std::string signature) {
  auto f = std::make_shared<impl::follower>();
  auto snap = troupe::detail::follow(c.state(), f);
  if (snap.devices.empty())
    throw invalid_argument("the cluster has no member that is up: no device to train on");
  // A member that leaves while the replicas start (drains, or dies before the cluster noticed)
  // is started without, as a runner does; its next process rejoins.
  start_without_leavers(snap.devices, snap.settings, troupe::detail::connect_timeout(c.state()),
                        "data_parallel", [&](std::vector<device> devices) {
                          *this = trainer(std::move(devices), cfg, o, job, make, signature);
                        });
  impl_->cluster = c.state();
  impl_->deadlines.connect = impl_->deadlines.spawn = troupe::detail::connect_timeout(c.state());
  impl_->follows = f;
  f->attach(impl_.get());
}

trainer::trainer(trainer&&) noexcept = default;
trainer& trainer::operator=(trainer&&) noexcept = default;
trainer::~trainer() {
  if (impl_ && impl_->follows) impl_->follows->detach();  // first: a change may be under way
}

double trainer::step(batch samples, mode m) {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  struct publish_after {  // also after a step that threw (its losses count)
    impl& p;
    ~publish_after() { p.publish(); }
  } after{*impl_};
  return impl_->step(samples, m);
}

void trainer::average_parameters() {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  auto& p = *impl_;
  auto live = p.alive();
  if (live.empty()) throw node_error("no replica left: every one was lost or removed");
  std::vector<std::vector<at::Tensor>> each;
  for (auto& [who, msg] : p.get_params(live)) each.push_back(std::move(msg.tensors));  // in order
  train_msg set;
  set.code = static_cast<std::uint8_t>(op::set_params);
  set.tensors = mean_parameters(each);
  p.everyone(p.alive(), set);
}

std::vector<at::Tensor> trainer::parameters() {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  auto& p = *impl_;
  for (auto who : p.alive()) {
    auto got = p.get_params({who});
    if (!got.empty()) return std::move(got.begin()->second.tensors);
  }
  throw node_error("no replica left: every one was lost or removed");
}

std::vector<at::Tensor> trainer::replica_parameters() {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  auto& p = *impl_;
  std::vector<at::Tensor> out;
  for (auto& [who, msg] : p.get_params(p.alive())) out.push_back(flat(msg.tensors));
  return out;
}

void trainer::save(const std::string& path) {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  auto& p = *impl_;
  for (auto who : p.alive()) {
    train_msg get;
    get.code = static_cast<std::uint8_t>(op::get_state);
    auto got = p.everyone({who}, get);
    if (got.empty()) continue;
    auto& bytes = got.begin()->second.tensors.at(0);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(static_cast<const char*>(bytes.data_ptr()), bytes.numel());
    if (!out) throw invalid_argument("cannot write " + path);
    return;
  }
  if (p.held_state.defined()) {  // the last replica was removed: its state is kept
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(static_cast<const char*>(p.held_state.data_ptr()), p.held_state.numel());
    if (!out) throw invalid_argument("cannot write " + path);
    return;
  }
  throw node_error("no replica left: every one was lost or removed");
}

void trainer::load(const std::string& path) {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  auto& p = *impl_;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw invalid_argument("cannot read " + path);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  train_msg set;
  set.code = static_cast<std::uint8_t>(op::set_state);
  set.tensors.push_back(bytes_tensor(bytes));
  if (p.alive().empty()) {  // kept for the replicas added next (checked as they load it)
    p.held_state = set.tensors[0];
    p.loaded = true;
    return;
  }
  // A replica whose load failed holds its old state (set_state puts it back): unlike the
  // others, which loaded the checkpoint (so the state is no longer the constructors' either way).
  p.loaded = true;
  p.everyone(p.alive(), set, /*drop_failed=*/true);
  if (p.coordinator) p.coordinator->states_equal();
  p.publish();  // replicas whose load failed were dropped
}

void trainer::add_devices(const std::vector<device>& devices) {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  impl_->add(devices);
  impl_->publish();
}

void trainer::remove_devices(const std::vector<device>& devices) {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  impl_->remove(devices);
  impl_->publish();
}

std::vector<device> trainer::devices() const {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  std::vector<device> out;
  for (auto& m : impl_->members)
    if (m.alive) out.push_back(m.d);
  return out;
}

train_stats trainer::stats() const {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  auto s = impl_->stats;
  for (auto& m : impl_->members) s.replicas.push_back(m.st);
  return s;
}

}  // namespace troupe::detail
