// Tensors as message payloads: dtype + shape + one raw byte block, validated on load.
// Include this header (or <troupe/torch.hpp>) wherever a job's items hold tensors, so that
// they serialize when they cross a network.
#pragma once

#include <ATen/core/Tensor.h>

#include <caf/deserializer.hpp>
#include <caf/error.hpp>
#include <caf/serializer.hpp>
#include <cstdint>
#include <string>
#include <vector>

namespace troupe {

/// The wire form of a tensor. The bytes are the tensor's contiguous CPU storage.
struct wire_tensor {
  std::int8_t dtype = 0;            ///< c10::ScalarType
  std::vector<std::int64_t> shape;  ///< empty for a 0-dim tensor
  std::vector<char> bytes;
};

/// Copies `t` (any dtype, shape, device, contiguous or not) into its wire form.
wire_tensor to_wire(const at::Tensor& t);

/// Rebuilds a CPU tensor. Throws troupe::protocol_error when dtype, shape and byte count do not
/// agree (never reads past the bytes).
at::Tensor from_wire(const wire_tensor& w);

caf::error save_tensor(caf::serializer& sink, const at::Tensor& t);
caf::error load_tensor(caf::deserializer& source, at::Tensor& t);

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, wire_tensor& x) {
  return f(caf::meta::type_name("troupe.tensor"), x.dtype, x.shape, x.bytes);
}

}  // namespace troupe

namespace at {

/// CAF inspection of tensors: found by argument-dependent lookup.
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, Tensor& x) {
  if constexpr (std::is_base_of<caf::serializer, Inspector>::value) {
    return troupe::save_tensor(f, x);
  } else if constexpr (std::is_base_of<caf::deserializer, Inspector>::value) {
    return troupe::load_tensor(f, x);
  } else {
    std::string desc = x.defined() ? x.toString() : std::string{"undefined tensor"};
    return f(desc);
  }
}

}  // namespace at
