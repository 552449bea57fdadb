#include "troupe/tensor.hpp"

#include <ATen/ATen.h>

#include <cstring>
#include <limits>

#include "troupe/error.hpp"
#include "troupe/messages.hpp"

namespace troupe {
namespace {

bool known_dtype(std::int8_t code) {
  switch (static_cast<c10::ScalarType>(code)) {
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
    case at::kHalf:
    case at::kFloat:
    case at::kDouble:
    case at::kBool:
    case at::kBFloat16:
    case at::kComplexFloat:
    case at::kComplexDouble:
      return true;
    default:
      return false;
  }
}

}  // namespace

wire_tensor to_wire(const at::Tensor& t) {
  if (!t.defined()) throw protocol_error("cannot send an undefined tensor");
  auto host = t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
  wire_tensor w;
  w.dtype = static_cast<std::int8_t>(host.scalar_type());
  w.shape.assign(host.sizes().begin(), host.sizes().end());
  w.bytes.resize(host.nbytes());
  if (!w.bytes.empty()) std::memcpy(w.bytes.data(), host.data_ptr(), w.bytes.size());
  return w;
}

at::Tensor from_wire(const wire_tensor& w) {
  if (!known_dtype(w.dtype))
    throw protocol_error("tensor with unknown dtype code " + std::to_string(w.dtype));
  auto type = static_cast<c10::ScalarType>(w.dtype);
  std::uint64_t count = 1;
  for (auto d : w.shape) {
    if (d < 0) throw protocol_error("tensor with a negative dimension");
    if (d != 0 && count > std::numeric_limits<std::uint64_t>::max() / static_cast<std::uint64_t>(d))
      throw protocol_error("tensor shape overflows");
    count *= static_cast<std::uint64_t>(d);
  }
  auto item = static_cast<std::uint64_t>(c10::elementSize(type));
  if (count > std::numeric_limits<std::uint64_t>::max() / item || count * item != w.bytes.size())
    throw protocol_error("tensor byte count " + std::to_string(w.bytes.size()) +
                         " does not match its shape and dtype");
  auto t = at::empty(w.shape, at::TensorOptions().dtype(type));
  if (!w.bytes.empty()) std::memcpy(t.data_ptr(), w.bytes.data(), w.bytes.size());
  return t;
}

caf::error save_tensor(caf::serializer& sink, const at::Tensor& t) {
  try {
    auto w = to_wire(t);
    return sink(w);
  } catch (const std::exception& e) {
    return make_error(errc::protocol_error, e.what());
  }
}

caf::error load_tensor(caf::deserializer& source, at::Tensor& t) {
  wire_tensor w;
  if (auto err = source(w)) return err;
  try {
    t = from_wire(w);
    return {};
  } catch (const std::exception& e) {
    return make_error(errc::protocol_error, e.what());
  }
}

}  // namespace troupe
