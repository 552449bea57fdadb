// LibTorch helpers for producers: the torch::Device of a troupe::device, and host-to-device
// copies from pinned memory on the producer's own CUDA stream.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "troupe/device.hpp"
#include "troupe/tensor.hpp"

namespace troupe {

/// The LibTorch device of a local troupe device ("cuda" means cuda:0).
c10::Device torch_device(const device& d);

/// Copies a host tensor to `d`: for CUDA devices through pinned memory and without blocking,
/// on the calling producer's stream; for CPU devices returns `host` unchanged.
at::Tensor to_device(const at::Tensor& host, const device& d);

/// Returns `t` on the host (a no-op for CPU tensors). Call it in the consumer, or in a producer
/// whose outputs must leave the GPU; otherwise outputs stay on the device.
at::Tensor to_host(const at::Tensor& t);

}  // namespace troupe
