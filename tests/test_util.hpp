// Small helpers shared by the test files.
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
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
#include <stdexcept>
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

/// A gate any number of threads can wait for, opened once.
class latch {
 public:
  void open() {
    std::lock_guard<std::mutex> guard{mtx_};
    open_ = true;
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock{mtx_};
    cv_.wait(lock, [this] { return open_; });
  }
  bool is_open() {
    std::lock_guard<std::mutex> guard{mtx_};
    return open_;
  }

 private:
  std::mutex mtx_;
  std::condition_variable cv_;
  bool open_ = false;
};

/// "127.0.0.1:PORT" with a port nobody listens on now (a node that must come back on its
/// address).
inline std::string free_loopback_address() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof sa;
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0;
  ::close(fd);
  if (!ok) throw std::runtime_error("no free port");
  return "127.0.0.1:" + std::to_string(ntohs(sa.sin_port));
}

}  // namespace test_util
