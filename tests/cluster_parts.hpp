// The helpers of the live-cluster tests (cluster_*_test.cpp): node processes on loopback, a
// recorder of membership events, jobs that run until told to stop. remote_squares is registered
// in node_test.cpp (the same test program).
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <troupe/detail/cluster_state.hpp>
#include <troupe/node.hpp>

#include "node_process.hpp"
#include "remote_jobs.hpp"
#include "test_util.hpp"
#include "wire_attack.hpp"

using test_util::iota;
using test_util::sum_of_squares;

namespace {

class node_process : public test_util::node_process {
 public:
  explicit node_process(const std::string& devices, std::vector<std::string> extra = {},
                        const std::string& serve = "127.0.0.1:0")
      : test_util::node_process(TROUPE_TEST_NODE, devices, std::move(extra), serve) {}
};

inline troupe::config slow(std::int64_t us) {
  troupe::config cfg;
  cfg.set("sleep_us", us);
  return cfg;
}

/// The membership events a cluster reported, and waits for them.
class recorder {
 public:
  std::function<void(const troupe::membership_event&)> callback() {
    return [this](const troupe::membership_event& e) {
      {
        std::lock_guard<std::mutex> guard{mtx_};
        events_.push_back(e);
        at_.push_back(std::chrono::steady_clock::now());
      }
      cv_.notify_all();
    };
  }
  /// Remembers now (a fault injected).
  void mark() {
    std::lock_guard<std::mutex> guard{mtx_};
    mark_ = std::chrono::steady_clock::now();
  }
  /// Milliseconds from mark() to the first `lost` of `node` (-1: none).
  double ms_after_freeze(const std::string& node) {
    std::lock_guard<std::mutex> guard{mtx_};
    for (std::size_t i = 0; i < events_.size(); ++i)
      if (events_[i].node == node && events_[i].what == troupe::membership_event::lost)
        return std::chrono::duration<double, std::milli>(at_[i] - mark_).count();
    return -1;
  }
  /// Waits (a watchdog bounds it) until `n` events of kind `k` about `node` were reported.
  void wait_for(troupe::membership_event::kind k, const std::string& node, std::size_t n = 1) {
    test_util::watchdog dog{std::chrono::seconds{60}, std::string{"the cluster reporting "} +
                                                          troupe::to_string(k) + " of " + node};
    std::unique_lock<std::mutex> lock{mtx_};
    cv_.wait(lock, [&] { return count_locked(k, node) >= n; });
  }
  std::size_t count(troupe::membership_event::kind k, const std::string& node) {
    std::lock_guard<std::mutex> guard{mtx_};
    return count_locked(k, node);
  }
  std::vector<troupe::membership_event::kind> of(const std::string& node) {
    std::lock_guard<std::mutex> guard{mtx_};
    std::vector<troupe::membership_event::kind> out;
    for (auto& e : events_)
      if (e.node == node) out.push_back(e.what);
    return out;
  }
  std::vector<troupe::membership_event> all() {
    std::lock_guard<std::mutex> guard{mtx_};
    return events_;
  }

 private:
  std::size_t count_locked(troupe::membership_event::kind k, const std::string& node) {
    std::size_t n = 0;
    for (auto& e : events_)
      if (e.what == k && e.node == node) ++n;
    return n;
  }
  std::mutex mtx_;
  std::condition_variable cv_;
  std::vector<troupe::membership_event> events_;
  std::vector<std::chrono::steady_clock::time_point> at_;
  std::chrono::steady_clock::time_point mark_;
};

/// Items the producers on `node` made (over every slot it ever had).
inline std::uint64_t items_on(const troupe::stats& s, const std::string& node) {
  std::uint64_t n = 0;
  for (auto& p : s.producers)
    if (!p.where.is_local() && p.where.node() == node) n += p.items;
  return n;
}

/// Sets a flag once a job has delivered `items`.
inline std::shared_ptr<std::atomic<bool>> flag_after(troupe::options& opts, std::uint64_t items) {
  auto flag = std::make_shared<std::atomic<bool>>(false);
  opts.on_progress = [flag, items](const troupe::progress& p) {
    if (p.done >= items) *flag = true;
  };
  return flag;
}

inline void wait_until(const std::atomic<bool>& flag, const char* what) {
  test_util::watchdog dog{std::chrono::seconds{60}, what};
  while (!flag) std::this_thread::sleep_for(std::chrono::milliseconds{2});
}

inline std::size_t entries(const char* dir) {
  std::size_t n = 0;
  if (DIR* d = ::opendir(dir)) {
    while (auto* e = ::readdir(d))
      if (e->d_name[0] != '.') ++n;
    ::closedir(d);
  }
  return n;
}

/// A live cluster's options for the freeze tests: events to `ev`, a heartbeat every 100 ms, lost
/// after 1 s of silence.
/// Waits for `ev`'s event `k` of `address`; a watchdog ends the test after 30 s (`what`).
inline void expect_event(recorder& ev, troupe::membership_event::kind k, const std::string& address,
                         const char* what) {
  test_util::watchdog dog{std::chrono::seconds{30}, what};
  ev.wait_for(k, address);
}

inline troupe::cluster_options watched_closely(recorder& ev) {
  troupe::cluster_options o;
  o.on_change = ev.callback();
  o.heartbeat = std::chrono::milliseconds{100};
  o.lost_after = std::chrono::milliseconds{2000};  // not reached by a loaded machine's pauses
  return o;
}

/// A job of at least `min_items` items that goes on until `more` is set, then `extra` more.
struct open_ended {
  std::shared_ptr<std::atomic<bool>> more = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<std::atomic<std::int64_t>> made = std::make_shared<std::atomic<std::int64_t>>(0);
  auto input(std::int64_t min_items, std::int64_t extra) const {
    return troupe::generate(
        [more = more, made = made, min_items, extra,
         stop = std::optional<std::int64_t>{}]() mutable -> std::optional<std::int64_t> {
          auto i = made->load();
          if (!stop && *more) stop = std::max(i, min_items) + extra;
          if ((stop && i >= *stop) || i >= 50'000'000) return std::nullopt;
          made->store(i + 1);
          return i;
        });
  }
};

/// A runner of remote_squares (`us` per item) that follows `c`, with an open-ended job under way
/// (2,000 items delivered); finish() ends the job and checks its result.
struct running_job {
  running_job(const troupe::cluster& c, std::int64_t us)
      : runner{c, slow(us), opts_with(started)}, job{runner.submit(in.input(0, 20'000))} {
    wait_until(*started, "the job under way");
  }
  static troupe::options opts_with(std::shared_ptr<std::atomic<bool>>& flag) {
    troupe::options o;
    o.speculative = false;
    flag = flag_after(o, 2'000);
    return o;
  }
  void finish() {
    *in.more = true;
    auto sum = job.get();  // before made is read: the generator runs until the job ends
    EXPECT_EQ(sum, sum_of_squares(in.made->load()));
  }
  std::shared_ptr<std::atomic<bool>> started;
  open_ended in;
  troupe::unordered_runner<remote_squares> runner;
  troupe::job_handle<std::int64_t> job;
};

}  // namespace
