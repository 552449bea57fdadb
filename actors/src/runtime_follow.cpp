// A runner that follows a live cluster (docs/api.md, "Pools that change"): the cluster's
// notifier thread tells it each membership change, in order; it starts producers on nodes that
// join or rejoin, drains those that drain and gives up on those that are lost.
#include <algorithm>
#include <caf/send.hpp>

#include "runtime_impl.hpp"
#include "troupe/detail/cluster_state.hpp"
#include "troupe/error.hpp"
#include "troupe/internal/ask_node.hpp"
#include "troupe/log.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

/// The runtime's place among a cluster's followers (attached_follower: registered before the
/// runtime exists).
class runtime_follower final : public attached_follower<runtime> {
 protected:
  void apply(runtime& rt, const membership_event& e) const override {
    if (!rt.is_open()) return;
    switch (e.what) {
      case membership_event::joined:
      case membership_event::rejoined:
        rt.join_node(e.node, e.devices);
        return;
      case membership_event::draining:
        rt.leave_node(e.node);
        return;
      case membership_event::lost:
        rt.fence_node(e.node);
        return;
      case membership_event::drained:
        return;
    }
  }
  bool only_on(runtime& rt, const std::string& node) const override {
    return rt.is_open() && rt.only_on(node);
  }
  [[nodiscard]] std::string name() const override { return "a runner following its cluster"; }
};

void runtime::follow(std::shared_ptr<cluster_state> c, std::shared_ptr<runtime_follower> f) {
  deadlines_.connect = deadlines_.spawn = connect_timeout(c);
  cluster_ = std::move(c);
  follower_ = std::move(f);
  follower_->attach(this);
}

void runtime::unfollow() noexcept {
  if (follower_) follower_->detach();
}

void runtime::join_node(const std::string& node, const std::vector<device>& devices) {
  std::vector<device> fresh;
  {
    std::lock_guard<std::mutex> member{membership_};
    nodes_.erase(node);  // a restarted node is another process: connect anew
    // Producers still present there (a drain that this runner could not make): not twice.
    auto here = present();
    std::vector<device> there;
    for (std::size_t i = 0; i < slots_.size() && i < here.size(); ++i)
      if (here[i] && !slots_[i].is_local() && slots_[i].node() == node) there.push_back(slots_[i]);
    for (auto& d : devices) {
      auto i = std::find(there.begin(), there.end(), d);
      if (i != there.end())
        there.erase(i);
      else
        fresh.push_back(d);
    }
  }
  add_devices(fresh);
}

void runtime::leave_node(const std::string& node) {
  std::vector<device> there;
  {
    std::lock_guard<std::mutex> member{membership_};
    auto here = present();
    for (std::size_t i = 0; i < slots_.size(); ++i)
      if (here[i] && !slots_[i].is_local() && slots_[i].node() == node) there.push_back(slots_[i]);
  }
  remove_devices(there);
}

void runtime::fence_node(const std::string& node) {
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (open_ && scheduler_) caf::anon_send(scheduler_, fence_atom::value, node);
  }
  // Its producers leave devices() once the scheduler has taken the fence (presence: the next
  // devices() publishes).
  std::lock_guard<std::mutex> member{membership_};
  nodes_.erase(node);  // never that process again
}

bool runtime::only_on(const std::string& node) {
  std::lock_guard<std::mutex> member{membership_};
  auto here = present();
  bool any = false;
  for (std::size_t i = 0; i < slots_.size() && i < here.size(); ++i) {
    if (!here[i]) continue;
    if (slots_[i].is_local() || slots_[i].node() != node) return false;
    any = true;
  }
  return any;
}

runtime_handle::runtime_handle(const cluster& c, config cfg, options opts, std::string job,
                               producer_maker make) {
  auto f = std::make_shared<runtime_follower>();
  auto snap = troupe::detail::follow(c.state(), f);
  if (snap.devices.empty())
    throw invalid_argument("the cluster has no member that is up: no device to start on");
  // A member that leaves while the runner starts there (an operator's rolling restart, a node
  // killed) is started without; any other refusal (a node without this job, say) is thrown.
  start_without_leavers(snap.devices, snap.settings, connect_timeout(c.state()), "a runner",
                        [&](std::vector<device> devices) {
                          impl_ =
                              std::make_unique<runtime>(std::move(devices), cfg, opts, job, make);
                        });
  impl_->follow(c.state(), std::move(f));
}

}  // namespace troupe::detail
