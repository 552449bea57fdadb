// troupe::torch: LibTorch helpers for producers and, with a CUDA LibTorch, the binding of
// producer threads to GPUs (installed into the core library when a program links troupe::torch).
#include "troupe/torch.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>

#include "troupe/device_binding.hpp"
#include "troupe/error.hpp"

#ifdef TROUPE_WITH_CUDA
#include <c10/core/DeviceGuard.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#endif

namespace troupe {

c10::Device torch_device(const device& d) {
  if (d.is_cpu()) return c10::Device{c10::kCPU};
  return c10::Device{c10::kCUDA, static_cast<c10::DeviceIndex>(d.index() < 0 ? 0 : d.index())};
}

at::Tensor to_device(const at::Tensor& host, const device& d) {
  if (d.is_cpu()) return host;
  auto pinned = host.is_pinned() ? host : host.pin_memory();
  return pinned.to(torch_device(d), /*non_blocking=*/true);
}

at::Tensor to_host(const at::Tensor& t) {
  return t.device().is_cpu() ? t : t.to(at::kCPU);
}

namespace {

/// A thread's intra-op budget. LibTorch's at::set_num_threads is process-wide; but the wheel's
/// intra-op backend is OpenMP, whose thread count is a per-thread setting that ATen's
/// parallel_for, MKL and oneDNN all read on the calling thread. ATen resets it once per thread
/// (its lazy init, on the first parallel call): that runs first here (at::get_num_threads), then
/// the thread's own OpenMP and MKL settings are made. Looked up at run time (dlsym): the
/// symbols live in the wheel's libgomp and libtorch_cpu, which troupe does not link by name.
void set_cpu_threads(int n) {
  using set_fn = void (*)(int);
  using mkl_fn = int (*)(int);
  static const auto omp = reinterpret_cast<set_fn>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  static const auto mkl =
      reinterpret_cast<mkl_fn>(dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local"));
  (void)at::get_num_threads();
  if (omp != nullptr) omp(n);
  if (mkl != nullptr) mkl(n);
}

const bool cpu_threads_installed = detail::install_cpu_threads(&set_cpu_threads);

}  // namespace

#ifdef TROUPE_WITH_CUDA
namespace {

class cuda_binding final : public device_binding {
 public:
  explicit cuda_binding(c10::DeviceIndex index)
      : stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index)), guard_(stream_) {
    detail::set_current_binding(this);
  }
  ~cuda_binding() override { detail::set_current_binding(nullptr); }
  void synchronize() override { stream_.synchronize(); }
  [[nodiscard]] void* stream() const noexcept override { return stream_.stream(); }

 private:
  c10::cuda::CUDAStream stream_;
  c10::cuda::CUDAStreamGuard guard_;  // sets the device and the current stream of this thread
};

int device_count() {
  int count = 0;  // cudaGetDeviceCount leaves it untouched on error (e.g. no driver: 35)
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error state
    count = 0;
  }
  return count;
}

std::unique_ptr<device_binding> bind(const device& d) {
  try {
    auto index = static_cast<c10::DeviceIndex>(d.index() < 0 ? 0 : d.index());
    c10::cuda::set_device(index);
    return std::make_unique<cuda_binding>(index);
  } catch (const c10::Error& e) {
    throw device_unavailable("device " + d.str() + ": " + e.what_without_backtrace());
  }
}

const bool installed = detail::install_cuda_support({&device_count, &bind});

}  // namespace
#endif

}  // namespace troupe

// Referenced by troupe::torch's link options (-Wl,--undefined): keeps this object, and so the
// CUDA support installed above, in every program that links the static library.
extern "C" const int troupe_torch_linked = 1;
