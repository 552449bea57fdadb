// Bulk payloads: a large batch (tensors, long vectors) crosses the network split into fragments
// of at most bulk::fragment_bytes, each an ordinary CAF message, followed by the message that
// carries a small reference to them. The fragments are written straight from the items' own
// storage, and joined on arrival into one buffer from which tensors are taken without a copy.
//
// Why: CAF 0.17's BASP builds and reads each message whole, and its length field is 32-bit and
// unchecked. Fragments keep every message small (no message near the 4 GiB limit, whatever the
// tensor size), and let the sender's serialization, the socket and the receiver's copy overlap.
//
// Ordering: CAF delivers the messages of one sender to one receiver in order, so when the
// reference arrives at an actor, every fragment of its stream has been delivered (and thus
// deserialized into the join buffer) before it.
#pragma once

#include <caf/actor.hpp>
#include <caf/deserializer.hpp>
#include <caf/error.hpp>
#include <caf/meta/type_name.hpp>
#include <caf/serializer.hpp>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "troupe/batch.hpp"

namespace troupe::bulk {

/// The largest fragment a sender writes.
constexpr std::size_t fragment_bytes = std::size_t{1} << 20;
/// Payloads of at least this many bytes go as fragments.
constexpr std::size_t threshold = std::size_t{1} << 20;
/// Raw blocks of at least this many bytes are referenced (not copied) by the sender, and start
/// on an `alignment` boundary of the join buffer, so that tensors can alias it.
constexpr std::size_t block_min = std::size_t{64} << 10;
constexpr std::size_t alignment = 64;
/// The largest payload a receiver accepts (its join buffer is reserved, not touched, up front).
constexpr std::uint64_t max_total = std::uint64_t{1} << 40;

/// A batch's serialized form as a list of slices: inline bytes it owns, and raw blocks that stay
/// in the items' own storage (kept alive by holding the batch).
class payload {
 public:
  /// Serializes `b` (whose item type is registered). Throws troupe::protocol_error.
  static std::shared_ptr<const payload> capture(const batch& b);

  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
  /// Writes bytes [offset, offset + len) as raw blocks.
  caf::error write(caf::serializer& sink, std::uint64_t offset, std::uint64_t len) const;

  /// Bytes [start, start + size) of the payload.
  struct slice {
    std::uint64_t start;
    const char* data;
    std::size_t size;
  };

 private:
  friend class writer;
  std::vector<slice> slices_;
  std::vector<std::vector<char>> owned_;
  batch keep_;
  std::uint64_t size_ = 0;
};

/// One piece of a stream. Senders fill `source`; receivers get the bytes written into the
/// stream's join buffer while the message is deserialized, so `source` stays empty.
struct fragment {
  std::uint64_t stream = 0;
  std::uint64_t offset = 0;
  std::uint64_t total = 0;
  std::uint64_t size = 0;
  std::shared_ptr<const payload> source;
};

caf::error save(caf::serializer& sink, const fragment& x);
caf::error load(caf::deserializer& source, fragment& x);

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, fragment& x) {
  if constexpr (std::is_base_of<caf::serializer, Inspector>::value) {
    return save(f, x);
  } else if constexpr (std::is_base_of<caf::deserializer, Inspector>::value) {
    return load(f, x);
  } else {
    return f(caf::meta::type_name("troupe.bulk_fragment"), x.stream, x.offset, x.total, x.size);
  }
}

/// A new stream id, unique across processes with overwhelming probability.
std::uint64_t next_stream_id();

/// The placeholder sent in place of a batch whose bytes travel as stream `stream`.
batch reference(std::uint64_t stream, std::uint64_t total, std::uint64_t items);

/// The stream id of a placeholder batch, or 0.
std::uint64_t stream_of(const batch& b) noexcept;

/// The batch a placeholder stands for, once every fragment of its stream has arrived; any other
/// batch unchanged. Throws troupe::protocol_error for an incomplete or malformed stream.
batch resolve(const batch& b);

/// An empty placeholder, filled by loading (batch::load_from uses it for the name "@bulk").
std::unique_ptr<batch_base> make_reference_batch();
/// Whether `b` is a placeholder.
bool is_reference(const batch_base* b) noexcept;

/// Streams whose fragments arrived and that were not resolved yet (for tests and leak checks).
std::size_t pending_streams();

/// Counters of this process: streams split and sent, streams joined and resolved.
struct counters {
  std::uint64_t sent = 0;
  std::uint64_t joined = 0;
};
counters totals() noexcept;
void count_sent() noexcept;

/// When `dest` lives on another node and `b` serializes to at least `threshold` bytes: sends
/// `b` to `dest` as fragments from `self`, and returns the placeholder to send in its place.
/// Otherwise returns `b`.
template <class Self>
batch split_for(Self* self, const caf::actor& dest, const batch& b) {
  if (!b || !dest || dest.node() == self->node()) return b;
  if (auto known = b.get()->flat_bytes(); known && *known < threshold) return b;  // no capture
  std::shared_ptr<const payload> p;
  try {
    p = payload::capture(b);
  } catch (...) {
    return b;  // CAF reports the failure when it serializes the message itself
  }
  if (p->size() < threshold) return b;
  auto id = next_stream_id();
  count_sent();
  for (std::uint64_t off = 0; off < p->size(); off += fragment_bytes) {
    auto len = std::min<std::uint64_t>(fragment_bytes, p->size() - off);
    self->send(dest, fragment{id, off, p->size(), len, p});
  }
  return reference(id, p->size(), b.size());
}

/// Reads a joined stream: a binary reader that skips the alignment padding before large raw
/// blocks and hands out views of them (tensors alias the buffer instead of copying it).
class reader final : public caf::deserializer {
 public:
  struct buffer;
  explicit reader(std::shared_ptr<buffer> buf);
  ~reader() override;

  [[nodiscard]] std::size_t remaining() const noexcept;
  /// The next `n` bytes (n >= block_min) in place, and the buffer that holds them.
  std::pair<char*, std::shared_ptr<void>> view(std::size_t n);

  caf::error begin_object(std::uint16_t& typenr, std::string& name) override;
  caf::error end_object() override;
  caf::error begin_sequence(std::size_t& num) override;
  caf::error end_sequence() override;
  caf::error apply_raw(std::size_t num_bytes, void* data) override;

 protected:
  caf::error apply_impl(std::int8_t& x) override;
  caf::error apply_impl(std::uint8_t& x) override;
  caf::error apply_impl(std::int16_t& x) override;
  caf::error apply_impl(std::uint16_t& x) override;
  caf::error apply_impl(std::int32_t& x) override;
  caf::error apply_impl(std::uint32_t& x) override;
  caf::error apply_impl(std::int64_t& x) override;
  caf::error apply_impl(std::uint64_t& x) override;
  caf::error apply_impl(float& x) override;
  caf::error apply_impl(double& x) override;
  caf::error apply_impl(long double& x) override;
  caf::error apply_impl(std::string& x) override;
  caf::error apply_impl(std::u16string& x) override;
  caf::error apply_impl(std::u32string& x) override;

 private:
  caf::error skip_padding(std::size_t n);
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::bulk
