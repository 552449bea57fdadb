// A live cluster's shared state (nodes/src/cluster.cpp) and what runners that follow it
// implement (actors/src/runtime_follow.cpp). Not included by <troupe/troupe.hpp>.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "troupe/log.hpp"
#include "troupe/node.hpp"

namespace troupe::detail {

/// A runner that follows a cluster. The cluster calls it on its notifier thread, one event at
/// a time, in order: joined / rejoined (start producers on the event's devices), draining
/// (drain the node's producers; returns when they are gone), lost (its producers are lost now,
/// their late answers dropped). It may throw (logged; cluster::add rethrows the first).
class cluster_follower {
 public:
  virtual ~cluster_follower() = default;
  virtual void on_event(const membership_event& e) = 0;
  /// Whether draining `node` would leave this runner without producers.
  [[nodiscard]] virtual bool needs(const std::string& node) const = 0;
};

/// A follower registered before its target (a runner, a data_parallel) exists, so that no
/// change between the cluster's snapshot and the target's start is missed: the changes it hears
/// until attach() are kept and applied then. detach() (the target going) waits for a change
/// under way in the target; none reaches it afterwards. needs() is not waited for by changes.
template <class Target>
class attached_follower : public cluster_follower {
 public:
  void on_event(const membership_event& e) final {
    Target* t = nullptr;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (!attached_) {
        pending_.push_back(e);
        return;
      }
      if (target_ == nullptr) return;
      t = target_;
      busy_ += 1;
    }
    in_use done{this};
    apply(*t, e);
  }

  [[nodiscard]] bool needs(const std::string& node) const final {
    Target* t = nullptr;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (target_ == nullptr) return false;
      t = target_;
      busy_ += 1;
    }
    in_use done{this};
    return only_on(*t, node);
  }

  /// The target exists: the changes kept so far are applied (a failure is logged).
  void attach(Target* t) {
    std::lock_guard<std::mutex> guard{mtx_};
    target_ = t;
    attached_ = true;
    for (auto& e : pending_) {
      try {
        apply(*t, e);
      } catch (const std::exception& x) {
        log(log_level::warn, name() + " could not act on its cluster's " + to_string(e.what) +
                                 " of " + e.node + ": " + x.what());
      }
    }
    pending_.clear();
  }

  /// The target goes: no change reaches it afterwards (waits for one being applied).
  void detach() noexcept {
    std::unique_lock<std::mutex> lock{mtx_};
    target_ = nullptr;
    attached_ = true;
    pending_.clear();
    idle_.wait(lock, [this] { return busy_ == 0; });
  }

 protected:
  /// Acts on `e` (may throw: the cluster logs it; cluster::add rethrows the first).
  virtual void apply(Target& t, const membership_event& e) const = 0;
  /// Whether draining `node` would leave `t` without producers (or replicas).
  virtual bool only_on(Target& t, const std::string& node) const = 0;
  /// How a warning names the target ("a runner following its cluster").
  [[nodiscard]] virtual std::string name() const = 0;

 private:
  /// A change (or needs()) under way in the target: detach() waits for its end.
  struct in_use {
    const attached_follower* f;
    ~in_use() {
      std::lock_guard<std::mutex> guard{f->mtx_};
      f->busy_ -= 1;
      f->idle_.notify_all();
    }
  };

  mutable std::mutex mtx_;
  mutable std::condition_variable idle_;
  mutable std::size_t busy_ = 0;  ///< changes (and needs()) running in the target now
  Target* target_ = nullptr;
  bool attached_ = false;
  std::vector<membership_event> pending_;
};

class cluster_state;

/// What a runner built from a cluster starts with: the devices of the members up now, and its
/// place among the followers (registered under the same lock, so that it hears every change
/// after the snapshot and none before).
struct cluster_snapshot {
  std::vector<device> devices;
  tls settings;
};

/// What an observer (troupe::metrics_text, the status page) reads of a live cluster.
struct cluster_view {
  std::uint64_t id = 0;  ///< its number in this process (1, 2, ...), never reused
  std::vector<member> members;
  std::size_t fenced_answers = 0;
};
/// Every cluster alive in this process, oldest first.
std::vector<cluster_view> cluster_views();

/// The cluster's connect_timeout: the longest a runner or trainer that follows it waits to
/// connect to a node and for the node's answer to a spawn.
std::chrono::milliseconds connect_timeout(const std::shared_ptr<cluster_state>& c);

/// Registers `f` and returns the devices it starts with (see cluster_snapshot).
cluster_snapshot follow(const std::shared_ptr<cluster_state>& c,
                        const std::shared_ptr<cluster_follower>& f);

}  // namespace troupe::detail
