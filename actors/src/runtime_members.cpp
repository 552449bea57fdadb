// A runner's producers while it runs (docs/api.md, "Pools that change"): add_devices starts
// producers and hands them to the scheduler; remove_devices drains them.
#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <optional>

#include "runtime_impl.hpp"
#include "troupe/error.hpp"
#include "troupe/log.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

namespace {

void refuse_internal(const char* what) {
  if (on_internal_thread())
    throw invalid_argument(std::string{what} +
                           " on troupe's own threads (on_progress, a producer, a consumer) would "
                           "wait for the scheduler that runs it: call it from another thread");
}

std::string listed(const std::vector<device>& ds) {
  std::string s;
  for (auto& d : ds) s += (s.empty() ? "" : ", ") + d.str();
  return s;
}

}  // namespace

void runtime::await(std::future<void>& f) {
  if (sim_) {
    sim_->drive([&] { return f.wait_for(std::chrono::seconds{0}) == std::future_status::ready; });
    if (f.wait_for(std::chrono::seconds{0}) != std::future_status::ready)
      throw testing::hang(
          "the simulation ran out of events before the runner's producers "
          "changed; see simulation::trace()");
    return;
  }
  f.wait();
}

std::unique_lock<std::mutex> runtime::begin_change(const char* what) {
  refuse_internal(what);
  std::unique_lock<std::mutex> member{membership_};
  std::lock_guard<std::mutex> guard{mtx_};
  if (!open_) throw runner_closed(std::string{what} + " after close(): create a new runner");
  return member;
}

void runtime::add_devices(const std::vector<device>& ds) {
  if (ds.empty()) return;
  auto member = begin_change("add_devices()");
  for (auto& d : ds) {
    if (d.is_local() || sim_) {
      if (auto why = why_unavailable(d); !why.empty() && !sim_) throw device_unavailable(why);
      continue;
    }
    if (!network_)
      throw invalid_argument("add_devices(): " + d.str() +
                             " is on a node, but this runner was built over local devices only: "
                             "name a node's device in the constructor's list to use nodes");
    if (job_.empty())
      throw invalid_argument(
          "add_devices(): devices on nodes need the job registered: "
          "TROUPE_REGISTER_JOB(your_job) here and in the nodes' programs");
  }
  auto first = slots_.size();
  std::vector<caf::actor> fresh;
  if (sim_) {
    fresh = start_simulated(ds, first);
  } else {
    {
      caf::scoped_actor self{*sys_};
      try {
        for (std::size_t i = 0; i < ds.size(); ++i)
          fresh.push_back(ds[i].is_local() ? spawn_(*sys_, ds[i], cfg_, first + i)
                                           : spawn_remote(ds[i], first + i));
      } catch (...) {
        for (auto& p : fresh) self->send_exit(p, caf::exit_reason::user_shutdown);
        throw;
      }
    }
    init_all(fresh, ds, first, /*keep_anchor=*/true);  // ends the new ones when one fails
  }
  {
    std::lock_guard<std::mutex> guard{stats_->mtx};
    for (std::size_t i = 0; i < ds.size(); ++i) {
      producer_stats ps;
      ps.index = first + i;
      ps.where = ds[i];
      stats_->value.producers.push_back(ps);
    }
  }
  auto done = std::make_shared<std::promise<void>>();
  auto added = done->get_future();
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (!open_) {
      for (auto& p : fresh) caf::anon_send_exit(p, caf::exit_reason::user_shutdown);
      std::lock_guard<std::mutex> stats_guard{stats_->mtx};
      for (std::size_t i = 0; i < ds.size(); ++i) stats_->value.producers[first + i].alive = false;
      throw runner_closed("the runner was closed while add_devices() started its producers");
    }
    auto msg = std::make_shared<producers_added>();
    msg->actors = fresh;
    msg->where = ds;
    msg->nodes = node_actors(ds);
    msg->first = first;
    msg->done = done;
    // Under the lock, as submit(): the scheduler has them before a close() (which stops them).
    caf::anon_send(scheduler_, std::move(msg));
  }
  await(added);
  slots_.insert(slots_.end(), ds.begin(), ds.end());
  publish();
  log(log_level::info, "added producer(s) on " + listed(ds));
}

const std::vector<device>& runtime::devices() const noexcept {
  // A producer lost or removed by the scheduler, not by a membership call (a node killed under
  // a runner built over a device list), leaves the list here, not at the next add or remove. The
  // scheduler cannot publish (add_devices holds membership_ while it waits for the scheduler):
  // it bumps presence, and the list is published again here. A membership call under way
  // publishes when it ends; this call does not wait for it.
  if (stats_->presence.load(std::memory_order_acquire) !=
      published_presence_.load(std::memory_order_acquire)) {
    auto* self = const_cast<runtime*>(this);  // never a const object: made by runner handles
    std::unique_lock<std::mutex> member{self->membership_, std::try_to_lock};
    if (member.owns_lock()) {
      try {
        self->publish();
      } catch (...) {  // out of memory: the previous list stays
      }
    }
  }
  return *current_.load();
}

void runtime::remove_devices(const std::vector<device>& ds) {
  if (ds.empty()) return;
  auto member = begin_change("remove_devices()");
  auto left = present();
  std::vector<std::size_t> slots;
  for (auto& d : ds) {
    std::size_t i = 0;
    while (i < slots_.size() && !(left[i] && slots_[i] == d)) ++i;
    if (i == slots_.size())
      throw invalid_argument("remove_devices(): " + d.str() +
                             " is not (or not that many times) among this runner's devices (" +
                             listed(published()) + "); nothing was removed");
    left[i] = false;
    slots.push_back(i);
  }
  if (std::none_of(left.begin(), left.end(), [](bool b) { return b; }))
    throw invalid_argument(
        "remove_devices() would leave the runner without producers: close() it instead; "
        "nothing was removed");
  auto done = std::make_shared<std::promise<void>>();
  auto drained = done->get_future();
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (!open_) throw runner_closed("remove_devices() after close()");
    auto msg = std::make_shared<drain_spec>();
    msg->slots = slots;
    msg->done = done;
    caf::anon_send(scheduler_, std::move(msg));
  }
  await(drained);
  publish();
  log(log_level::info, "removed producer(s) on " + listed(ds));
}

void runtime_handle::add_devices(std::vector<device> devices) {
  checked().add_devices(devices);
}

void runtime_handle::remove_devices(std::vector<device> devices) {
  checked().remove_devices(devices);
}

}  // namespace troupe::detail
