// Binds the calling thread to a device for a producer's lifetime: for cuda:N it makes N the
// thread's current device and installs a CUDA stream of the producer's own as the current
// stream, so that LibTorch operations and the producer's kernels queue on it.
#pragma once

#include <memory>

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

/// The stream of the producer running on the calling thread (a cudaStream_t), or nullptr when
/// the thread belongs to no CUDA producer.
void* current_stream() noexcept;

}  // namespace troupe
