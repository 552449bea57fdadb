// A runner that follows a live cluster (docs/api.md, "Pools that change"): the cluster's
// notifier thread tells it each membership change, in order; it starts producers on nodes that
// join or rejoin, drains those that drain and gives up on those that are lost.
#include <algorithm>
#include <caf/send.hpp>
#include <condition_variable>

#include "runtime_impl.hpp"
#include "troupe/detail/cluster_state.hpp"
#include "troupe/error.hpp"
#include "troupe/log.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

/// The runtime's place among a cluster's followers. Registered before the runtime exists (so
/// that no change between the cluster's snapshot and the runtime's start is missed): the
/// changes it hears until attach() are kept and applied then.
class runtime_follower final : public cluster_follower {
 public:
  void on_event(const membership_event& e) override {
    runtime* rt = nullptr;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (!attached_) {
        pending_.push_back(e);
        return;
      }
      if (rt_ == nullptr) return;
      rt = rt_;
      busy_ += 1;  // detach() waits for it; needs() does not
    }
    in_use done{this};
    apply(*rt, e);
  }

  [[nodiscard]] bool needs(const std::string& node) const override {
    runtime* rt = nullptr;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      rt = rt_;
      if (rt == nullptr) return false;
      busy_ += 1;
    }
    in_use done{this};
    return rt->is_open() && rt->only_on(node);
  }

  void attach(runtime* rt) {
    std::lock_guard<std::mutex> guard{mtx_};
    rt_ = rt;
    attached_ = true;
    for (auto& e : pending_) {
      try {
        apply(*rt_, e);
      } catch (const std::exception& x) {
        log(log_level::warn, std::string{"a runner following its cluster could not act on "} +
                                 to_string(e.what) + " of " + e.node + ": " + x.what());
      }
    }
    pending_.clear();
  }

  /// The runtime goes: no change reaches it afterwards (waits for one being applied).
  void detach() noexcept {
    std::unique_lock<std::mutex> lock{mtx_};
    rt_ = nullptr;
    attached_ = true;
    pending_.clear();
    idle_.wait(lock, [this] { return busy_ == 0; });
  }

 private:
  /// A change (or needs()) under way in the runtime: detach() waits for its end.
  struct in_use {
    const runtime_follower* f;
    ~in_use() {
      std::lock_guard<std::mutex> guard{f->mtx_};
      f->busy_ -= 1;
      f->idle_.notify_all();
    }
  };

  static void apply(runtime& rt, const membership_event& e) {
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

  mutable std::mutex mtx_;
  mutable std::condition_variable idle_;
  mutable std::size_t busy_ = 0;  ///< changes (and needs()) running in the runtime now
  runtime* rt_ = nullptr;
  bool attached_ = false;
  std::vector<membership_event> pending_;
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
  impl_ = std::make_unique<runtime>(std::move(snap.devices), std::move(cfg), std::move(opts),
                                    std::move(job), make);
  impl_->follow(c.state(), std::move(f));
}

}  // namespace troupe::detail
