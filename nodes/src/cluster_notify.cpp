// A live cluster's notifier thread (cluster_core.hpp): tells the runners that follow the
// cluster, then on_change, one change at a time, in order; drains for cluster::remove.
#include <optional>

#include "cluster_core.hpp"
#include "troupe/error.hpp"
#include "troupe/log.hpp"

namespace troupe::detail {

thread_local bool on_notifier = false;

void cluster_core::tell(batch& b, const membership_event& e) {
  for (auto& w : b.to) {
    auto f = w.lock();
    if (!f) continue;
    try {
      f->on_event(e);
    } catch (const std::exception& x) {
      log(log_level::warn, std::string{"a runner following the cluster could not act on "} +
                               to_string(e.what) + " of " + e.node + ": " + x.what());
      if (!b.first_error) b.first_error = std::current_exception();
    } catch (...) {
      log(log_level::warn, std::string{"a runner following the cluster could not act on "} +
                               to_string(e.what) + " of " + e.node);
      if (!b.first_error) b.first_error = std::current_exception();
    }
  }
}

void cluster_core::report(const membership_event& e) {
  log(e.what == membership_event::lost ? log_level::warn : log_level::info,
      "cluster: " + e.node + " " + to_string(e.what) + " (incarnation " +
          std::to_string(e.incarnation) + ")");
  if (!o_.on_change) return;
  try {
    o_.on_change(e);
  } catch (...) {
    log(log_level::error, "cluster_options::on_change threw; ignored");
  }
}

void cluster_core::notify_loop() {
  on_notifier = true;
  for (;;) {
    std::shared_ptr<batch> b;
    {
      std::unique_lock<std::mutex> lock{mtx_};
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping
      b = queue_.front();
      queue_.pop_front();
    }
    if (!b->removing.empty()) {
      drain(*b);
    } else {
      for (auto& e : b->events) {
        if (e.what == membership_event::draining) {
          report(e);  // the node drains itself: it told the coordinators of its producers
          continue;
        }
        tell(*b, e);
        report(e);
      }
    }
    b->done.set_value();
  }
}

void cluster_core::drain(batch& b) {
  auto& address = b.removing;
  membership_event e;
  try {
    {
      std::lock_guard<std::mutex> guard{mtx_};
      auto st = core_.state_of(address);
      if (!st || *st != member::state::up)
        throw invalid_argument("cluster::remove: " + address + " is " +
                               (st ? to_string(*st) : "not a member") + ", not up");
    }
    for (auto& w : b.to)
      if (auto f = w.lock(); f && f->needs(address))
        throw invalid_argument("cluster::remove: " + address +
                               " has the last producers of a runner that follows the cluster: "
                               "add another node first, or close that runner; nothing was "
                               "drained");
    std::lock_guard<std::mutex> guard{mtx_};
    e = core_.begin_drain(address);
  } catch (...) {
    b.first_error = std::current_exception();
    return;
  }
  report(e);
  tell(b, e);
  std::optional<membership_event> d;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (b.first_error)
      core_.cancel_drain(address);
    else
      d = core_.end_drain(address);
  }
  if (d) {
    tell(b, *d);
    report(*d);
  }
}

}  // namespace troupe::detail
