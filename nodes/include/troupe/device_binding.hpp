// Binds the calling thread to a device for a producer's lifetime: for cuda:N it makes N the
// thread's current device and installs a CUDA stream of the producer's own as the current
// stream, so that LibTorch operations and the producer's kernels queue on it.
#pragma once

#include <memory>
#include <string>

#include "troupe/device.hpp"

namespace troupe {

class device_binding {
 public:
  virtual ~device_binding() = default;
  /// Waits until the work queued on the producer's stream has finished.
  virtual void synchronize() = 0;
  /// The producer's stream as a cudaStream_t (nullptr for CPU devices).
  [[nodiscard]] virtual void* stream() const noexcept = 0;
};

/// Binds the calling thread to `d` (a local device). CPU devices need no binding: returns
/// nullptr. Throws troupe::device_unavailable when `d` cannot be used here.
std::unique_ptr<device_binding> bind_device(const device& d);

namespace detail {
/// How this process binds CUDA devices: installed by troupe::torch (torch/src/torch.cpp) when
/// a program links it; without it, only CPU devices are usable and gpus() is empty.
struct cuda_support {
  int (*device_count)() = nullptr;
  std::unique_ptr<device_binding> (*bind)(const device& d) = nullptr;
};
/// Installs `s` (once, from a static initializer of troupe::torch).
bool install_cuda_support(const cuda_support& s) noexcept;
/// GPUs this process can use through the installed CUDA support; -1 when none is installed.
int cuda_device_count() noexcept;
/// Makes `b` the calling thread's binding (nullptr: none), for current_stream().
void set_current_binding(device_binding* b) noexcept;

/// How this process gives a thread its LibTorch intra-op thread budget (OpenMP's and MKL's
/// per-thread settings): installed by troupe::torch; without it, CPU producers get none.
bool install_cpu_threads(void (*set)(int n)) noexcept;
/// CPU producers alive in this process (from their spawn to their actor's end): +1 or -1.
void count_cpu_producer(int delta) noexcept;
/// Gives the calling thread (a CPU producer's, before its constructor) its intra-op budget:
/// `requested` when above 0 (cfg "torch.intra_op_threads"), else usable_cores() divided among
/// the CPU producers alive, at least 1, and at most OMP_NUM_THREADS when that is set. Returns the
/// budget set, 0 without troupe::torch.
int apply_cpu_thread_budget(int requested) noexcept;
/// OMP_NUM_THREADS's value as a cap on the default budget: its first number when positive
/// ("4", "4,2"), else 0 (none: unset, empty, 0 or not a number).
int omp_threads_cap(const char* value) noexcept;
/// The cores this process may use, at least 1: the CPUs of its affinity mask (taskset, a
/// cpuset), and no more than its cgroup's CPU quota rounded up (a container's CPU limit, e.g. a
/// Kubernetes pod's `limits: cpu: "2"`: cgroup v2's cpu.max, or v1's cfs_quota_us/period_us).
/// std::thread::hardware_concurrency() counts the machine's cores, whatever the limit.
int usable_cores() noexcept;
/// The cores a cgroup v2 cpu.max line allows ("QUOTA PERIOD", rounded up), 0 for no limit
/// ("max PERIOD") or a line it cannot read.
int cores_of_cpu_max(const std::string& line) noexcept;
}  // namespace detail

/// The stream of the producer running on the calling thread (a cudaStream_t), or nullptr when
/// the thread belongs to no CUDA producer.
void* current_stream() noexcept;

}  // namespace troupe
