// The receiver's side of bulk payloads (troupe/internal/bulk.hpp): a deserializer over a joined
// buffer that hands out views of its aligned blocks.
#include <caf/binary_deserializer.hpp>
#include <caf/sec.hpp>

#include "bulk_buffers.hpp"

namespace troupe::bulk {

using pages::padding;

// -- the receiver's side ------------------------------------------------------------------------

struct reader::impl {
  std::shared_ptr<buffer> buf;
  caf::binary_deserializer inner;
  explicit impl(std::shared_ptr<buffer> b)
      : buf(std::move(b)),
        inner(static_cast<caf::execution_unit*>(nullptr), buf->mem.data,
              static_cast<std::size_t>(buf->size)) {}
};

reader::reader(std::shared_ptr<buffer> buf) : impl_(std::make_unique<impl>(std::move(buf))) {}
reader::~reader() = default;

std::size_t reader::remaining() const noexcept {
  return impl_->inner.remaining();
}

caf::error reader::skip_padding(std::size_t n) {
  if (n < block_min) return {};
  auto pad = padding(impl_->buf->size - remaining());
  if (pad > remaining()) return caf::make_error(caf::sec::end_of_stream);
  impl_->inner.skip(pad);
  return {};
}

std::pair<char*, std::shared_ptr<void>> reader::view(std::size_t n) {
  if (auto err = skip_padding(n); err || n > remaining()) return {nullptr, nullptr};
  auto* at = impl_->buf->mem.data + (impl_->buf->size - remaining());
  impl_->inner.skip(n);
  return {at, impl_->buf};
}

caf::error reader::begin_object(std::uint16_t& typenr, std::string& name) {
  return impl_->inner.begin_object(typenr, name);
}
caf::error reader::end_object() {
  return impl_->inner.end_object();
}
caf::error reader::begin_sequence(std::size_t& num) {
  return impl_->inner.begin_sequence(num);
}
caf::error reader::end_sequence() {
  return impl_->inner.end_sequence();
}
caf::error reader::apply_raw(std::size_t num_bytes, void* data) {
  if (auto err = skip_padding(num_bytes)) return err;
  return impl_->inner.apply_raw(num_bytes, data);
}
caf::error reader::apply_impl(std::int8_t& x) {
  return impl_->inner(x);
}
caf::error reader::apply_impl(std::uint8_t& x) {
  return impl_->inner(x);
}
caf::error reader::apply_impl(std::int16_t& x) {
  return impl_->inner(x);
}
caf::error reader::apply_impl(std::uint16_t& x) {
  return impl_->inner(x);
}
caf::error reader::apply_impl(std::int32_t& x) {
  return impl_->inner(x);
}
caf::error reader::apply_impl(std::uint32_t& x) {
  return impl_->inner(x);
}
caf::error reader::apply_impl(std::int64_t& x) {
  return impl_->inner(x);
}
caf::error reader::apply_impl(std::uint64_t& x) {
  return impl_->inner(x);
}
caf::error reader::apply_impl(float& x) {
  return impl_->inner(x);
}
caf::error reader::apply_impl(double& x) {
  return impl_->inner(x);
}
caf::error reader::apply_impl(long double& x) {
  return impl_->inner(x);
}
caf::error reader::apply_impl(std::string& x) {
  return impl_->inner(x);
}
caf::error reader::apply_impl(std::u16string& x) {
  return impl_->inner(x);
}
caf::error reader::apply_impl(std::u32string& x) {
  return impl_->inner(x);
}

}  // namespace troupe::bulk
