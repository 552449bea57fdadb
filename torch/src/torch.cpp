// troupe::torch: LibTorch helpers for producers and, with a CUDA LibTorch, the binding of
// producer threads to GPUs (installed into the core library when a program links troupe::torch).
#include "troupe/torch.hpp"

#include <ATen/ATen.h>

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
