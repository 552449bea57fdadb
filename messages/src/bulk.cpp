#include "troupe/internal/bulk.hpp"

#include <algorithm>
#include <atomic>
#include <caf/binary_deserializer.hpp>
#include <caf/binary_serializer.hpp>
#include <caf/sec.hpp>
#include <chrono>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <unordered_map>

#include "bulk_buffers.hpp"
#include "troupe/error.hpp"
#include "troupe/protocol.hpp"

namespace troupe::bulk {
namespace {

using clock_type = std::chrono::steady_clock;
using pages::padding;

// -- streams being joined -------------------------------------------------------------------

struct join {
  std::shared_ptr<reader::buffer> buf;
  std::uint64_t received = 0;
  clock_type::time_point touched;
};

/// A stream not touched for this long is dropped (its sender died mid-way).
constexpr auto stale_after = std::chrono::seconds{120};

class join_table {
 public:
  /// The join buffer of `stream`, created on its first fragment; nullptr when `total` disagrees
  /// with the stream's or no memory can be reserved.
  std::shared_ptr<reader::buffer> open(std::uint64_t stream, std::uint64_t total) {
    std::lock_guard<std::mutex> guard{mtx_};
    auto now = clock_type::now();
    auto i = streams_.find(stream);
    if (i == streams_.end()) {
      for (auto j = streams_.begin(); j != streams_.end();)
        j = now - j->second.touched > stale_after ? streams_.erase(j) : std::next(j);
      auto buf = std::make_shared<reader::buffer>(total);
      if (buf->mem.data == nullptr && total > 0) return nullptr;
      i = streams_.emplace(stream, join{std::move(buf), 0, now}).first;
    }
    if (i->second.buf->size != total) return nullptr;
    i->second.touched = now;
    return i->second.buf;
  }

  void received(std::uint64_t stream, std::uint64_t n) {
    std::lock_guard<std::mutex> guard{mtx_};
    auto i = streams_.find(stream);
    if (i != streams_.end()) i->second.received += n;
  }

  /// Removes and returns a stream's join; received is its byte count so far.
  std::optional<join> take(std::uint64_t stream) {
    std::lock_guard<std::mutex> guard{mtx_};
    auto i = streams_.find(stream);
    if (i == streams_.end()) return std::nullopt;
    auto j = std::move(i->second);
    streams_.erase(i);
    return j;
  }

  std::size_t size() {
    std::lock_guard<std::mutex> guard{mtx_};
    return streams_.size();
  }

 private:
  std::mutex mtx_;
  std::unordered_map<std::uint64_t, join> streams_;
};

join_table& joins() {
  static auto* instance = new join_table;
  return *instance;
}

/// Stands in for a batch whose bytes travel as a stream of fragments.
class ref_batch final : public batch_base {
 public:
  ref_batch() = default;
  ref_batch(std::uint64_t stream, std::uint64_t total, std::uint64_t items)
      : stream_(stream), total_(total), items_(items) {}
  [[nodiscard]] std::size_t size() const noexcept override { return items_; }
  [[nodiscard]] const std::type_info& item_type() const noexcept override {
    return typeid(ref_batch);
  }
  caf::error save(caf::serializer& sink) const override {
    auto s = stream_, t = total_, n = items_;
    return sink(s, t, n);
  }
  caf::error load(caf::deserializer& source) override { return source(stream_, total_, items_); }
  [[nodiscard]] std::shared_ptr<batch_base> slice(std::size_t, std::size_t) const override {
    throw std::logic_error("a bulk reference cannot be sliced before it is resolved");
  }
  [[nodiscard]] std::uint64_t stream() const noexcept { return stream_; }
  [[nodiscard]] std::uint64_t total() const noexcept { return total_; }

 private:
  std::uint64_t stream_ = 0;
  std::uint64_t total_ = 0;
  std::uint64_t items_ = 0;
};

}  // namespace

// -- the sender's side ------------------------------------------------------------------------

/// Serializes into a payload: small values into owned bytes, large raw blocks by reference.
class writer final : public caf::serializer {
 public:
  explicit writer(payload& p) : p_(p), inner_(static_cast<caf::execution_unit*>(nullptr), cur_) {}

  void finish() { flush(); }

  caf::error begin_object(std::uint16_t& typenr, std::string& name) override {
    return inner_.begin_object(typenr, name);
  }
  caf::error end_object() override { return inner_.end_object(); }
  caf::error begin_sequence(std::size_t& num) override { return inner_.begin_sequence(num); }
  caf::error end_sequence() override { return inner_.end_sequence(); }
  caf::error apply_raw(std::size_t num_bytes, void* data) override {
    if (num_bytes < block_min) return inner_.apply_raw(num_bytes, data);
    cur_.resize(cur_.size() + padding(p_.size_ + cur_.size()));
    flush();
    p_.slices_.push_back({p_.size_, static_cast<const char*>(data), num_bytes});
    p_.size_ += num_bytes;
    return {};
  }

 protected:
  caf::error apply_impl(std::int8_t& x) override { return inner_(x); }
  caf::error apply_impl(std::uint8_t& x) override { return inner_(x); }
  caf::error apply_impl(std::int16_t& x) override { return inner_(x); }
  caf::error apply_impl(std::uint16_t& x) override { return inner_(x); }
  caf::error apply_impl(std::int32_t& x) override { return inner_(x); }
  caf::error apply_impl(std::uint32_t& x) override { return inner_(x); }
  caf::error apply_impl(std::int64_t& x) override { return inner_(x); }
  caf::error apply_impl(std::uint64_t& x) override { return inner_(x); }
  caf::error apply_impl(float& x) override { return inner_(x); }
  caf::error apply_impl(double& x) override { return inner_(x); }
  caf::error apply_impl(long double& x) override { return inner_(x); }
  caf::error apply_impl(std::string& x) override { return inner_(x); }
  caf::error apply_impl(std::u16string& x) override { return inner_(x); }
  caf::error apply_impl(std::u32string& x) override { return inner_(x); }

 private:
  void flush() {
    if (cur_.empty()) return;
    p_.owned_.push_back(std::move(cur_));  // moving keeps the bytes where they are
    auto& bytes = p_.owned_.back();
    p_.slices_.push_back({p_.size_, bytes.data(), bytes.size()});
    p_.size_ += bytes.size();
    cur_ = {};
    inner_.seek(0);
  }

  payload& p_;
  std::vector<char> cur_;
  caf::binary_serializer inner_;
};

std::shared_ptr<const payload> payload::capture(const batch& b) {
  auto p = std::make_shared<payload>();
  p->keep_ = b;
  writer w{*p};
  if (auto err = b.save_to(w))
    throw protocol_error("cannot serialize a batch: " + caf::to_string(err));
  w.finish();
  return p;
}

caf::error payload::write(caf::serializer& sink, std::uint64_t offset, std::uint64_t len) const {
  if (offset > size_ || len > size_ - offset) return caf::make_error(caf::sec::invalid_argument);
  // The slice holding `offset`, then on until `len` bytes are written.
  auto i = std::upper_bound(slices_.begin(), slices_.end(), offset,
                            [](std::uint64_t off, const slice& s) { return off < s.start; });
  if (i != slices_.begin()) --i;
  for (; len > 0 && i != slices_.end(); ++i) {
    if (offset >= i->start + i->size) continue;
    auto skip = offset - i->start;
    auto n = std::min<std::uint64_t>(len, i->size - skip);
    if (auto err = sink.apply_raw(static_cast<std::size_t>(n), const_cast<char*>(i->data + skip)))
      return err;
    offset += n;
    len -= n;
  }
  return {};
}

// -- fragments ----------------------------------------------------------------------------------

caf::error save(caf::serializer& sink, const fragment& x) {
  if (!x.source || x.offset > x.source->size() || x.size > x.source->size() - x.offset)
    return make_error(errc::protocol_error, "a bulk fragment without its bytes");
  auto stream = x.stream, offset = x.offset, total = x.total, size = x.size;
  if (auto err = sink(stream, offset, total, size)) return err;
  return x.source->write(sink, x.offset, x.size);
}

caf::error load(caf::deserializer& source, fragment& x) {
  if (auto err = source(x.stream, x.offset, x.total, x.size)) return err;
  if (x.size > detail::bytes_left(source))
    return make_error(errc::protocol_error, "bulk fragment announces more bytes than it holds");
  if (x.total > max_total || x.offset > x.total || x.size > x.total - x.offset)
    return make_error(errc::protocol_error, "bulk fragment out of its stream's bounds");
  auto buf = joins().open(x.stream, x.total);
  if (!buf)
    return make_error(errc::protocol_error, "bulk stream " + std::to_string(x.stream) +
                                                " cannot be joined (size mismatch or no memory)");
  if (x.size > 0)
    if (auto err = source.apply_raw(static_cast<std::size_t>(x.size), buf->mem.data + x.offset))
      return err;
  joins().received(x.stream, x.size);
  return {};
}

std::uint64_t next_stream_id() {
  static const std::uint64_t seed = [] {
    std::random_device rd;
    return (std::uint64_t{rd()} << 32) ^ rd() ^
           static_cast<std::uint64_t>(clock_type::now().time_since_epoch().count());
  }();
  static std::atomic<std::uint64_t> counter{0};
  for (;;) {  // splitmix64 of seed + n: a bijection, so ids never repeat within a process
    std::uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (counter.fetch_add(1) + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    if (z != 0) return z;
  }
}

batch reference(std::uint64_t stream, std::uint64_t total, std::uint64_t items) {
  return batch{std::make_shared<ref_batch>(stream, total, items)};
}

std::uint64_t stream_of(const batch& b) noexcept {
  auto* ref = dynamic_cast<const ref_batch*>(b.get());
  return ref ? ref->stream() : 0;
}

std::size_t pending_streams() {
  return joins().size();
}

namespace {
std::atomic<std::uint64_t> streams_sent{0};
std::atomic<std::uint64_t> streams_joined{0};
}  // namespace

void count_sent() noexcept {
  streams_sent.fetch_add(1, std::memory_order_relaxed);
}

counters totals() noexcept {
  return {streams_sent.load(std::memory_order_relaxed),
          streams_joined.load(std::memory_order_relaxed)};
}

batch resolve(const batch& b) {
  auto* ref = dynamic_cast<const ref_batch*>(b.get());
  if (ref == nullptr) return b;
  auto id = std::to_string(ref->stream());
  auto j = joins().take(ref->stream());
  if (!j) throw protocol_error("bulk payload " + id + " never arrived");
  if (j->buf->size != ref->total() || j->received != ref->total())
    throw protocol_error("bulk payload " + id + " is incomplete: " + std::to_string(j->received) +
                         " of " + std::to_string(ref->total()) + " bytes");
  reader r{j->buf};
  batch out;
  if (auto err = out.load_from(r))
    throw protocol_error("bulk payload " + id + " is malformed: " + error_text(err));
  if (r.remaining() != 0 || out.size() != ref->size() || stream_of(out) != 0)
    throw protocol_error("bulk payload " + id + " does not match its reference");
  streams_joined.fetch_add(1, std::memory_order_relaxed);
  return out;
}

std::unique_ptr<batch_base> make_reference_batch() {
  return std::make_unique<ref_batch>();
}

bool is_reference(const batch_base* b) noexcept {
  return dynamic_cast<const ref_batch*>(b) != nullptr;
}

}  // namespace troupe::bulk
