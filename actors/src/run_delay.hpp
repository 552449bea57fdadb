// How long the calling thread has waited for a CPU while it could run (Linux's run delay, the
// second number of /proc/thread-self/schedstat), so that a producer's call is timed by what it
// cost, not by what the machine's other threads cost it: a call preempted for 2 ms, or whose
// thread the kernel queued behind another producer's on a busy CPU, would otherwise read as a
// slow patch of items or as a fixed cost per call (docs/api.md, "The chunk sizer's cost model").
#pragma once

#include <cstdint>

#if defined(__linux__)
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#endif

namespace troupe::detail {

/// The calling thread's run delay so far (ns): 0 where the kernel does not tell it (not Linux,
/// no schedstat, no file descriptor left). One pread on a file kept open per thread: 0.3 to
/// 0.5 us.
inline std::int64_t thread_run_delay_ns() {
#if defined(__linux__)
  struct schedstat_file {
    int fd = ::open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    schedstat_file() = default;
    schedstat_file(const schedstat_file&) = delete;
    schedstat_file& operator=(const schedstat_file&) = delete;
    ~schedstat_file() {
      if (fd >= 0) ::close(fd);
    }
  };
  thread_local schedstat_file file;
  if (file.fd < 0) return 0;
  char text[96];
  auto n = ::pread(file.fd, text, sizeof text - 1, 0);
  if (n <= 0) return 0;
  text[n] = '\0';
  char* end = nullptr;
  std::strtoull(text, &end, 10);  // time on a CPU
  auto delay = std::strtoull(end, nullptr, 10);
  return static_cast<std::int64_t>(delay);
#else
  return 0;
#endif
}

}  // namespace troupe::detail
