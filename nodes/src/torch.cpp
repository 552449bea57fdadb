#include "troupe/torch.hpp"

#include <ATen/ATen.h>

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

}  // namespace troupe
