#include "troupe/device_binding.hpp"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "troupe/error.hpp"

namespace troupe {
namespace {
thread_local device_binding* current_binding = nullptr;

detail::cuda_support& cuda() {
  static auto& s = *new detail::cuda_support;  // never destroyed: producers outlive exit()
  return s;
}

std::atomic<void (*)(int)> cpu_threads{nullptr};
std::atomic<int> cpu_producers{0};
}  // namespace

namespace detail {

bool install_cuda_support(const cuda_support& s) noexcept {
  cuda() = s;
  return true;
}

void set_current_binding(device_binding* b) noexcept {
  current_binding = b;
}

bool install_cpu_threads(void (*set)(int n)) noexcept {
  cpu_threads = set;
  return true;
}

void count_cpu_producer(int delta) noexcept {
  cpu_producers += delta;
}

int omp_threads_cap(const char* value) noexcept {
  if (value == nullptr) return 0;
  char* end = nullptr;
  auto n = std::strtol(value, &end, 10);  // "4" or a list, "4,2": its first level
  if (end == value || (*end != '\0' && *end != ',') || n <= 0) return 0;
  return static_cast<int>(std::min<long>(n, 1 << 20));
}

int apply_cpu_thread_budget(int requested) noexcept {
  auto set = cpu_threads.load();
  if (set == nullptr) return 0;
  int n = requested;
  if (n <= 0) {
    n = std::max(1, usable_cores() / std::max(1, cpu_producers.load()));
    // An operator's OMP_NUM_THREADS (several processes sharing a host) caps the share, as it
    // caps PyTorch's own intra-op threads.
    if (auto cap = omp_threads_cap(std::getenv("OMP_NUM_THREADS")); cap > 0) n = std::min(n, cap);
  }
  set(n);
  return n;
}

int cores_of_cpu_max(const std::string& line) noexcept {
  long long quota = 0, period = 0;
  if (std::sscanf(line.c_str(), "%lld %lld", &quota, &period) != 2 || quota <= 0 || period <= 0)
    return 0;  // "max 100000": no limit
  return static_cast<int>(std::min<long long>((quota + period - 1) / period, 1 << 20));
}

int usable_cores() noexcept {
  int n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) n = std::max(1, CPU_COUNT(&set));
  int quota = 0;
  try {
    std::ifstream v2{"/sys/fs/cgroup/cpu.max"};
    std::string line;
    if (v2 && std::getline(v2, line)) {
      quota = cores_of_cpu_max(line);
    } else {
      std::ifstream q{"/sys/fs/cgroup/cpu/cpu.cfs_quota_us"},
          p{"/sys/fs/cgroup/cpu/cpu.cfs_period_us"};
      std::string qs, ps;
      if (q && p && std::getline(q, qs) && std::getline(p, ps))
        quota = cores_of_cpu_max(qs + " " + ps);
    }
  } catch (...) {  // unreadable: no limit known
  }
  return quota > 0 ? std::max(1, std::min(n, quota)) : n;
}

int cuda_device_count() noexcept {
  auto f = cuda().device_count;
  return f ? f() : -1;
}

}  // namespace detail

std::unique_ptr<device_binding> bind_device(const device& d) {
  if (auto why = why_unavailable(d); !why.empty()) throw device_unavailable(why);
  if (d.is_cpu()) return nullptr;
  auto bind = cuda().bind;
  if (bind == nullptr)
    throw device_unavailable("device " + d.str() +
                             ": CUDA producers need troupe::torch (link it into this program)");
  return bind(d);
}

void* current_stream() noexcept {
  return current_binding ? current_binding->stream() : nullptr;
}

}  // namespace troupe
