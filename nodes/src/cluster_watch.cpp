// A live cluster's watcher (probes every member each heartbeat, and gives up on the silent
// ones) and reconnector (tries lost members again) threads (cluster_core.hpp).
#include <algorithm>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <future>
#include <iterator>
#include <set>
#include <thread>

#include "cluster_core.hpp"
#include "troupe/detail/network.hpp"
#include "troupe/log.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

bool cluster_core::pause(std::chrono::milliseconds d) {
  std::unique_lock<std::mutex> lock{mtx_};
  return !cv_.wait_for(lock, d, [&] { return stopping_; });
}

void cluster_core::guarded(const char* name, void (cluster_core::*loop)(),
                           std::chrono::milliseconds again) {
  while (!stopping()) {
    try {
      (this->*loop)();
      return;
    } catch (const std::exception& e) {
      log(log_level::error, std::string{name} + ": " + e.what());
    } catch (...) {
      log(log_level::error, std::string{name} + ": an unknown exception");
    }
    pause(again);
  }
}

void cluster_core::watch_loop() {
  while (!stopping()) {
    auto start = clock::now();
    std::vector<std::pair<std::string, caf::actor>> targets;
    std::chrono::milliseconds every;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      for (auto& a : core_.watched())
        if (auto i = handles_.find(a); i != handles_.end()) targets.emplace_back(a, i->second);
      // Many members: probed less often (probes_per_second), and lost after as many probes
      // missed as with few.
      every = probe_every_ = probe_period(o_, targets.size());
      core_.set_lost_after(scaled_lost_after(o_, every));
    }
    struct answer {
      std::string address;
      node_hello hello;
    };
    std::vector<answer> answers;
    if (!targets.empty()) {
      caf::scoped_actor self{*sys_};
      using req = decltype(self->request(targets[0].second, every, hello_atom::value));
      std::vector<req> pending;
      for (auto& [a, h] : targets) pending.push_back(self->request(h, every, hello_atom::value));
      for (std::size_t i = 0; i < pending.size(); ++i)
        pending[i].receive(
            [&](node_hello& h) {
              answers.push_back({targets[i].first, std::move(h)});
            },
            [](const caf::error&) {});  // silent: counted by lost_after
    }
    std::shared_ptr<batch> b;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      auto now = clock::now();
      auto events = take_notices_locked(now);
      auto add = [&](std::vector<membership_event> more) {
        events.insert(events.end(), more.begin(), more.end());
      };
      for (auto& x : answers) {
        std::vector<device> offered;
        try {
          offered = devices_at(x.address, x.hello.devices);
        } catch (const std::exception&) {
          continue;  // a device this program does not know: not a sign of life to use
        }
        add(core_.answered(x.address, x.hello.incarnation, offered, now, false, x.hello.leaving));
      }
      add(core_.tick(now));
      if (!events.empty()) b = enqueue(std::move(events));
    }
    if (b) cv_.notify_all();
    auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - start);
    if (spent < every && !pause(every - spent)) return;
  }
}

void cluster_core::reconnect_loop() {
  // Each address at most once per reconnect_every; but one that drained itself (a rolling
  // restart: its next process is expected within moments) every heartbeat, so that it is
  // back in the running jobs soon after it listens again.
  std::map<std::string, clock::time_point> next_try;
  while (pause(std::min(o_.heartbeat, o_.reconnect_every))) {
    // Lost members, and members silent for two heartbeats: a node restarted on the same
    // address answers a connect as a new incarnation long before lost_after.
    std::vector<std::string> lost;
    std::set<std::string> eager;
    auto now = clock::now();
    {
      std::lock_guard<std::mutex> guard{mtx_};
      lost = core_.lost();
      auto quiet = core_.silent(now, 2 * probe_every_);
      lost.insert(lost.end(), quiet.begin(), quiet.end());
      for (auto& a : lost)
        if (core_.leaves_by_itself(a)) eager.insert(a);
    }
    for (auto i = next_try.begin(); i != next_try.end();)  // members back: forgotten
      i = std::find(lost.begin(), lost.end(), i->first) == lost.end() ? next_try.erase(i)
                                                                      : std::next(i);
    // The addresses due now, tried at once (a wave of at most 64 threads at a time): one after
    // the other, K addresses that never answer held a restarted node's rejoin back K times
    // connect_timeout or CAF's idle timeout (8 of them: 10.6 s instead of 1.2 s).
    std::vector<std::string> due;
    for (auto& address : lost) {
      if (!eager.count(address)) {
        auto& at = next_try[address];
        if (now < at) continue;
        at = now + o_.reconnect_every;
      }
      due.push_back(address);
    }
    struct attempt {
      std::vector<std::string> offered;
      std::uint64_t incarnation = 0;
      bool leaving = false;
      caf::actor handle;  // null: not back yet
    };
    constexpr std::size_t wave = 64;
    for (std::size_t from = 0; from < due.size(); from += wave) {
      if (stopping()) return;
      auto to = std::min(due.size(), from + wave);
      std::vector<std::future<attempt>> tries;
      for (auto i = from; i < to; ++i)
        tries.push_back(std::async(std::launch::async, [this, address = due[i]] {
          attempt a;
          try {
            a.handle = connect_node(*sys_, address, t_, o_.connect_timeout, &a.offered,
                                    &a.incarnation, &a.leaving, [this] { return stopping(); });
          } catch (const std::exception&) {
          }
          return a;
        }));
      // Each taken as it comes: a member back is not held behind the silent ones' attempts.
      std::vector<bool> taken(tries.size(), false);
      for (auto left = tries.size(); left > 0;) {
        for (std::size_t k = 0; k < tries.size(); ++k) {
          if (taken[k] ||
              tries[k].wait_for(std::chrono::milliseconds{0}) != std::future_status::ready)
            continue;
          taken[k] = true;
          left -= 1;
          auto got = tries[k].get();
          if (got.handle && !stopping())
            rejoin(due[from + k], std::move(got.handle), got.incarnation, got.offered, got.leaving);
        }
        if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds{20});
      }
    }
  }
}

void cluster_core::rejoin(const std::string& address, caf::actor handle, std::uint64_t incarnation,
                          const std::vector<std::string>& offered, bool leaving) {
  if (ask_to_start_over(address, handle, incarnation)) return;  // its next answer rejoins
  std::vector<device> devices;
  try {
    devices = devices_at(address, offered);
  } catch (const std::exception& e) {
    log(log_level::warn, "cluster: " + address +
                             " offers a device this program does not "
                             "know (" +
                             e.what() + "); not used");
    return;
  }
  std::shared_ptr<batch> b;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    auto now = clock::now();
    if (auto other = core_.spelled_otherwise(address, incarnation)) {
      // Another spelling of a member's address (given to connect and not up then): one member
      // is enough, this address is not retried.
      core_.retire(address);
      log(log_level::warn, "cluster: " + address + " is the node " + *other +
                               " (the same process): no longer tried");
      return;
    }
    // Notices first: a node that drained itself has left, whatever answers now.
    auto events = take_notices_locked(now);
    auto more = core_.answered(address, incarnation, devices, now, false, leaving);
    events.insert(events.end(), more.begin(), more.end());
    if (core_.accepts(address, incarnation)) {
      handles_[address] = handle;
      watch(handle);
    }
    if (!events.empty()) b = enqueue(std::move(events));
  }
  if (b) cv_.notify_all();
}

bool cluster_core::ask_to_start_over(const std::string& address, const caf::actor& handle,
                                     std::uint64_t incarnation) {
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (!core_.fenced(address, incarnation)) return false;
    core_.answered(address, incarnation, {}, clock::now(), false);  // counted, not used
  }
  // The process this cluster gave up on (frozen or cut off past lost_after) is back. Nothing of
  // it is used again; it starts over as a new incarnation, as a restart would, and the next
  // probe admits that one (rejoined): a healed partition needs no operator.
  caf::anon_send(handle, given_up_atom::value, incarnation);
  log(log_level::warn, "cluster: " + address + " answers as the process given up on (incarnation " +
                           std::to_string(incarnation) +
                           "): asked to start over as a new incarnation");
  return true;
}

std::vector<membership_event> cluster_core::take_notices_locked(clock::time_point now) {
  std::vector<std::pair<caf::actor_addr, std::uint64_t>> notices;
  std::vector<caf::actor_addr> gone;
  {
    std::lock_guard<std::mutex> guard{sink_->mtx};
    notices.swap(sink_->notices);
    gone.swap(sink_->gone);
  }
  // The member whose current node actor is `a` (a restarted process, or another node served by
  // the same process, is another actor), if any.
  auto member_of = [this](const caf::actor_addr& a) -> const std::string* {
    for (auto& [address, handle] : handles_)
      if (handle.address() == a) return &address;
    return nullptr;
  };
  std::vector<membership_event> events;
  // The members' devices, copied once (not once per notice: a rolling drain of a fleet sends one
  // per node); a notice changes only its own member.
  auto members = notices.empty() ? decltype(core_.members()){} : core_.members();
  for (auto& [where, incarnation] : notices)
    if (auto* address = member_of(where))
      for (auto& m : members)
        if (m.address == *address) {
          auto more = core_.answered(m.address, incarnation, m.devices, now, false, true);
          events.insert(events.end(), more.begin(), more.end());
        }
  // After the notices: a node that said it drains, then exited, is drained, not lost.
  for (auto& where : gone)
    if (auto* address = member_of(where))
      if (auto e = core_.gone(*address)) events.push_back(*e);
  return events;
}

void cluster_core::downs_loop() {
  while (pause(std::chrono::milliseconds{100})) {
    {
      std::lock_guard<std::mutex> guard{sink_->mtx};
      if (sink_->gone.empty()) continue;
    }
    std::shared_ptr<batch> b;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (auto events = take_notices_locked(clock::now()); !events.empty())
        b = enqueue(std::move(events));
    }
    if (b) cv_.notify_all();
  }
}

void cluster_core::watch(const caf::actor& node) {
  if (listener_) caf::anon_send(listener_, watch_atom::value, node);
}

bool cluster_core::stopping() {
  std::lock_guard<std::mutex> guard{mtx_};
  return stopping_;
}

}  // namespace troupe::detail
