// Small helpers shared by the test files.
#pragma once

#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace test_util {

/// 0, 1, ..., n-1
inline std::vector<std::int64_t> iota(std::int64_t n) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

/// The sum of x*x over iota(n).
inline std::int64_t sum_of_squares(std::int64_t n) {
  std::int64_t s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += i * i;
  return s;
}

/// This process's peak resident memory (VmHWM), KiB.
inline std::size_t peak_rss_kib() {
  std::ifstream status{"/proc/self/status"};
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoul(line.substr(6));
  return 0;
}

/// The threads of this process (/proc/self/task).
inline std::size_t thread_count() {
  std::size_t n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (auto* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  return n;
}

/// For a case that could hang: past `limit` it prints `what`, every thread's stack (gdb, when
/// installed) and aborts, so that a hang names its parties instead of waiting for CTest's
/// timeout. Disarmed when destroyed.
class watchdog {
 public:
  watchdog(std::chrono::seconds limit, std::string what)
      : what_(std::move(what)), thread_([this, limit] { watch(limit); }) {}
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;
  ~watchdog() {
    {
      std::lock_guard<std::mutex> guard{mtx_};
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void watch(std::chrono::seconds limit) {
    std::unique_lock<std::mutex> lock{mtx_};
    if (cv_.wait_for(lock, limit, [this] { return done_; })) return;
    std::cerr << "watchdog: hung after " << limit.count() << " s: " << what_ << std::endl;
    auto cmd =
        "gdb -p " + std::to_string(getpid()) + " -batch -ex 'thread apply all bt' 2>/dev/null 1>&2";
    if (std::system(cmd.c_str()) != 0) std::cerr << "watchdog: no gdb for the stacks" << std::endl;
    std::abort();
  }

  std::string what_;
  std::mutex mtx_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace test_util
