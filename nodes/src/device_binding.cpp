#include "troupe/device_binding.hpp"

#include "troupe/error.hpp"

#ifdef TROUPE_WITH_CUDA
#include <c10/core/DeviceGuard.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <optional>
#endif

namespace troupe {
namespace {
thread_local device_binding* current_binding = nullptr;
}

#ifdef TROUPE_WITH_CUDA
namespace {

class cuda_binding final : public device_binding {
 public:
  explicit cuda_binding(c10::DeviceIndex index)
      : stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index)), guard_(stream_) {
    current_binding = this;
  }
  ~cuda_binding() override { current_binding = nullptr; }
  void synchronize() override { stream_.synchronize(); }
  [[nodiscard]] void* stream() const noexcept override { return stream_.stream(); }

 private:
  c10::cuda::CUDAStream stream_;
  c10::cuda::CUDAStreamGuard guard_;  // sets the device and the current stream of this thread
};

}  // namespace
#endif

std::unique_ptr<device_binding> bind_device(const device& d) {
  if (auto why = why_unavailable(d); !why.empty()) throw device_unavailable(why);
  if (d.is_cpu()) return nullptr;
#ifdef TROUPE_WITH_CUDA
  try {
    auto index = static_cast<c10::DeviceIndex>(d.index() < 0 ? 0 : d.index());
    c10::cuda::set_device(index);
    return std::make_unique<cuda_binding>(index);
  } catch (const c10::Error& e) {
    throw device_unavailable("device " + d.str() + ": " + e.what_without_backtrace());
  }
#else
  throw device_unavailable("device " + d.str() + ": troupe was built without CUDA support");
#endif
}

void* current_stream() noexcept {
  return current_binding ? current_binding->stream() : nullptr;
}

}  // namespace troupe
