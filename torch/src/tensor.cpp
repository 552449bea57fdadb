#include "troupe/tensor.hpp"

#include <ATen/ATen.h>

#include <cstring>
#include <limits>

#include "troupe/error.hpp"
#include "troupe/internal/bulk.hpp"
#include "troupe/protocol.hpp"

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

/// The dtype of a wire header, after checking that dtype, shape and byte count agree.
c10::ScalarType check_header(std::int8_t dtype, const std::vector<std::int64_t>& shape,
                             std::uint64_t nbytes) {
  if (!known_dtype(dtype))
    throw protocol_error("tensor with unknown dtype code " + std::to_string(dtype));
  auto type = static_cast<c10::ScalarType>(dtype);
  std::uint64_t count = 1;
  for (auto d : shape) {
    if (d < 0) throw protocol_error("tensor with a negative dimension");
    if (d != 0 && count > std::numeric_limits<std::uint64_t>::max() / static_cast<std::uint64_t>(d))
      throw protocol_error("tensor shape overflows");
    count *= static_cast<std::uint64_t>(d);
  }
  auto item = static_cast<std::uint64_t>(c10::elementSize(type));
  if (count > std::numeric_limits<std::uint64_t>::max() / item || count * item != nbytes)
    throw protocol_error("tensor byte count " + std::to_string(nbytes) +
                         " does not match its shape and dtype");
  return type;
}

/// An uninitialized CPU tensor for the given wire header.
at::Tensor empty_for(std::int8_t dtype, const std::vector<std::int64_t>& shape,
                     std::uint64_t nbytes) {
  return at::empty(shape, at::TensorOptions().dtype(check_header(dtype, shape, nbytes)));
}

at::Tensor host_contiguous(const at::Tensor& t) {
  if (!t.defined()) throw protocol_error("cannot send an undefined tensor");
  return t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
}

}  // namespace

wire_tensor to_wire(const at::Tensor& t) {
  auto host = host_contiguous(t);
  wire_tensor w;
  w.dtype = static_cast<std::int8_t>(host.scalar_type());
  w.shape.assign(host.sizes().begin(), host.sizes().end());
  w.bytes.resize(host.nbytes());
  if (!w.bytes.empty()) std::memcpy(w.bytes.data(), host.data_ptr(), w.bytes.size());
  return w;
}

at::Tensor from_wire(const wire_tensor& w) {
  auto t = empty_for(w.dtype, w.shape, w.bytes.size());
  if (!w.bytes.empty()) std::memcpy(t.data_ptr(), w.bytes.data(), w.bytes.size());
  return t;
}

// On the network a tensor is: dtype, shape, byte count, then its bytes in one raw block, written
// from and read into the tensor's own storage (no intermediate copy).
caf::error save_tensor(caf::serializer& sink, const at::Tensor& t) {
  try {
    auto host = host_contiguous(t);
    auto dtype = static_cast<std::int8_t>(host.scalar_type());
    std::vector<std::int64_t> shape(host.sizes().begin(), host.sizes().end());
    std::uint64_t nbytes = host.nbytes();
    if (auto err = sink(dtype, shape, nbytes)) return err;
    return nbytes ? sink.apply_raw(nbytes, host.data_ptr()) : caf::error{};
  } catch (const std::exception& e) {
    return make_error(errc::protocol_error, e.what());
  }
}

caf::error load_tensor(caf::deserializer& source, at::Tensor& t) {
  std::int8_t dtype = 0;
  std::vector<std::int64_t> shape;
  std::uint64_t nbytes = 0;
  if (auto err = source(dtype, shape, nbytes)) return err;
  if (nbytes > detail::bytes_left(source))
    return make_error(errc::protocol_error, "tensor announces more bytes than its message holds");
  try {
    // A large tensor of a joined bulk payload aliases the join buffer: no copy.
    if (auto* joined = dynamic_cast<bulk::reader*>(&source);
        joined != nullptr && nbytes >= bulk::block_min) {
      auto type = check_header(dtype, shape, nbytes);
      auto [data, keep] = joined->view(static_cast<std::size_t>(nbytes));
      if (data == nullptr) return caf::make_error(caf::sec::end_of_stream);
      t = at::from_blob(
          data, shape, [keep = std::move(keep)](void*) mutable { keep.reset(); },
          at::TensorOptions().dtype(type));
      return {};
    }
    auto fresh = empty_for(dtype, shape, nbytes);
    if (nbytes)
      if (auto err = source.apply_raw(nbytes, fresh.data_ptr())) return err;
    t = std::move(fresh);
    return {};
  } catch (const std::exception& e) {
    return make_error(errc::protocol_error, e.what());
  }
}

}  // namespace troupe
