// troupe::batch: a type-erased vector of items, the payload of every work and output message.
// Locally it is a shared handle (sending it copies no item); across a network it is written as
// a registered type name followed by the items, through CAF's inspectors.
#pragma once

#include <algorithm>
#include <atomic>
#include <caf/deserializer.hpp>
#include <caf/detail/type_traits.hpp>
#include <caf/error.hpp>
#include <caf/meta/type_name.hpp>
#include <caf/sec.hpp>
#include <caf/serializer.hpp>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

namespace troupe {

namespace detail {
/// Bytes left to read in `source` when it is a binary deserializer (BASP's), else SIZE_MAX.
/// Loaders check announced sizes against it before allocating.
std::size_t bytes_left(caf::deserializer& source) noexcept;

template <class T>
constexpr bool raw_items = std::is_arithmetic<T>::value && !std::is_same<T, bool>::value;

/// A struct of plain data with no inspect() overload: trivially copyable, default-constructible
/// and without padding (every byte belongs to a value), e.g. struct point { float x, y; }. Its
/// items cross the network as one block of bytes, like numbers. Its members must be values, not
/// pointers (an address means nothing in another process): a struct that holds pointers needs
/// an inspect() overload, and then goes field by field.
template <class T>
constexpr bool plain_struct =
    std::is_class<T>::value&& std::is_trivially_copyable<T>::value&& std::is_default_constructible<
        T>::value&& std::has_unique_object_representations<T>::value &&
    !caf::detail::is_serializable<T>::value;

/// Items written as one block of bytes: numbers, and plain structs.
template <class T>
constexpr bool wire_raw = raw_items<T> || plain_struct<T>;

/// Items that can cross the network: an inspect() overload (CAF), or plain structs.
template <class T>
constexpr bool wire_serializable = caf::detail::is_serializable<T>::value || plain_struct<T>;

template <class T, class = void>
struct has_nbytes : std::false_type {};
template <class T>
struct has_nbytes<T, std::void_t<decltype(std::declval<const T&>().nbytes())>> : std::true_type {};

template <class T, class = void>
struct is_contiguous_container : std::false_type {};
template <class T>
struct is_contiguous_container<
    T, std::void_t<decltype(std::declval<const T&>().data()),
                   decltype(std::declval<const T&>().size()), typename T::value_type>>
    : std::true_type {};

/// An estimate of the bytes an item holds, used to bound chunk sizes.
template <class T>
std::size_t payload_bytes(const T& x) {
  if constexpr (has_nbytes<T>::value)
    return sizeof(T) + static_cast<std::size_t>(x.nbytes());
  else if constexpr (is_contiguous_container<T>::value)
    return sizeof(T) + x.size() * sizeof(typename T::value_type);
  else
    return sizeof(T);
}

/// Items whose payload_bytes() is their whole size: numbers, tensors, strings and vectors of
/// numbers (not nested containers or structs, which may hold more on the heap).
template <class T, class = void>
struct flat_item : std::bool_constant<std::is_arithmetic<T>::value || has_nbytes<T>::value> {};
template <class T>
struct flat_item<T, std::enable_if_t<is_contiguous_container<T>::value>>
    : std::is_arithmetic<typename T::value_type> {};
}  // namespace detail

/// A caller's contiguous range of numbers lent to a job's local producers instead of copied on
/// the scheduler's thread (runner.run(vector)): a producer's work loop copies a block of it
/// (a few KiB, into a buffer of its own) between acquire() and release(), then calls work() on
/// the copies; the job's handle revokes the lease and waits for such a copy under way (never
/// for work()) before the caller may touch the range again. Lock-free for the readers: two
/// atomic operations each side (a mutex only to wake a revoker that waits).
class range_lease {
 public:
  /// A producer is about to read the range: false once it has been revoked (do not read).
  bool acquire() noexcept {
    readers_.fetch_add(1);
    if (!revoked_.load()) return true;
    release();
    return false;
  }
  void release() noexcept {
    // seq_cst on both sides: a reader that does not see revoked_ has its decrement seen by
    // the revoker's check of readers_, so a wake-up is never needed and never missed.
    if (readers_.fetch_sub(1) == 1 && revoked_.load()) {
      std::lock_guard<std::mutex> guard{mtx_};
      cv_.notify_all();
    }
  }
  /// Nobody reads the range once this returns (a copy under way finishes first).
  void revoke_and_wait() {
    revoked_.store(true);
    std::unique_lock<std::mutex> lock{mtx_};
    cv_.wait(lock, [this] { return readers_.load() == 0; });
  }

 private:
  std::atomic<std::size_t> readers_{0};
  std::atomic<bool> revoked_{false};
  std::mutex mtx_;
  std::condition_variable cv_;
};

class batch_base {
 public:
  virtual ~batch_base() = default;
  /// A batch of items that belong to the caller (a lent range), else nullptr.
  [[nodiscard]] virtual range_lease* lease() const noexcept { return nullptr; }
  /// A batch that views items it does not own (batch_view): their first byte, else nullptr.
  [[nodiscard]] virtual const void* view_data() const noexcept { return nullptr; }
  [[nodiscard]] virtual std::size_t size() const noexcept = 0;
  [[nodiscard]] virtual const std::type_info& item_type() const noexcept = 0;
  /// The items' size in memory when their type makes it cheap and exact (detail::flat_item),
  /// else nothing.
  [[nodiscard]] virtual std::optional<std::size_t> flat_bytes() const noexcept {
    return std::nullopt;
  }
  virtual caf::error save(caf::serializer& sink) const = 0;
  virtual caf::error load(caf::deserializer& source) = 0;
  /// A copy of items [from, to) (for a retried item, or outputs around a skipped one).
  [[nodiscard]] virtual std::shared_ptr<batch_base> slice(std::size_t from,
                                                          std::size_t to) const = 0;
  /// Items [from, to) of a batch that views items it does not own, as a view under the same
  /// lease (nothing is read); nullptr for a batch that owns its items.
  [[nodiscard]] virtual std::shared_ptr<batch_base> sub_view(std::size_t from,
                                                             std::size_t to) const {
    (void)from;
    (void)to;
    return nullptr;
  }
  /// These items followed by those of `other`, a batch of the same type (a simulated item
  /// failure: the outputs around it).
  [[nodiscard]] virtual std::shared_ptr<batch_base> concat(const batch_base& other) const {
    (void)other;
    throw std::logic_error("this batch cannot be concatenated");
  }
};

template <class T>
class batch_of final : public batch_base {
 public:
  batch_of() = default;
  explicit batch_of(std::vector<T> xs) : items(std::move(xs)) {}
  std::vector<T> items;

  [[nodiscard]] std::size_t size() const noexcept override { return items.size(); }
  [[nodiscard]] const std::type_info& item_type() const noexcept override { return typeid(T); }
  [[nodiscard]] std::optional<std::size_t> flat_bytes() const noexcept override {
    if constexpr (detail::wire_raw<T>) {
      return items.size() * sizeof(T);
    } else if constexpr (detail::flat_item<T>::value) {
      std::size_t n = 0;
      for (const auto& x : items) n += detail::payload_bytes(x);
      return n;
    } else {
      return std::nullopt;
    }
  }
  caf::error save(caf::serializer& sink) const override {
    if constexpr (detail::wire_raw<T>) {  // numbers, plain structs: one block, not item by item
      std::uint64_t n = items.size();
      if (auto err = sink(n)) return err;
      return sink.apply_raw(n * sizeof(T), const_cast<T*>(items.data()));
    } else if constexpr (caf::detail::is_serializable<T>::value)
      return sink(const_cast<std::vector<T>&>(items));
    else
      return caf::make_error(caf::sec::state_not_serializable);
  }
  [[nodiscard]] std::shared_ptr<batch_base> slice(std::size_t from, std::size_t to) const override {
    if constexpr (std::is_copy_constructible<T>::value) {
      return std::make_shared<batch_of<T>>(
          std::vector<T>(items.begin() + static_cast<std::ptrdiff_t>(from),
                         items.begin() + static_cast<std::ptrdiff_t>(to)));
    } else {
      throw std::logic_error("items of this type cannot be copied: no retries or skips");
    }
  }
  [[nodiscard]] std::shared_ptr<batch_base> concat(const batch_base& other) const override {
    auto* more = dynamic_cast<const batch_of<T>*>(&other);
    if (more == nullptr) throw std::logic_error("concatenating batches of different types");
    if constexpr (std::is_copy_constructible<T>::value) {
      auto out = std::make_shared<batch_of<T>>(items);
      out->items.insert(out->items.end(), more->items.begin(), more->items.end());
      return out;
    } else {
      throw std::logic_error("items of this type cannot be copied");
    }
  }
  caf::error load(caf::deserializer& source) override {
    if constexpr (detail::wire_raw<T>) {
      std::uint64_t n = 0;
      if (auto err = source(n)) return err;
      if (n > detail::bytes_left(source) / sizeof(T))
        return caf::make_error(caf::sec::end_of_stream);
      items.resize(n);
      return source.apply_raw(n * sizeof(T), items.data());
    } else if constexpr (caf::detail::is_serializable<T>::value)
      return source(items);
    else
      return caf::make_error(caf::sec::state_not_serializable);
  }
};

/// Numbers the batch does not own: a part of a caller's contiguous range (with its range_lease),
/// or of a producer's own buffer (no lease). Written to the wire like batch_of<T> (it arrives
/// as one); a slice of it is a copy.
template <class T>
class batch_view final : public batch_base {
 public:
  batch_view(const T* data, std::size_t n, std::shared_ptr<range_lease> lease)
      : data_(data), n_(n), lease_(std::move(lease)) {}
  [[nodiscard]] const T* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept override { return n_; }
  [[nodiscard]] const std::type_info& item_type() const noexcept override { return typeid(T); }
  [[nodiscard]] range_lease* lease() const noexcept override { return lease_.get(); }
  [[nodiscard]] const void* view_data() const noexcept override { return data_; }
  [[nodiscard]] std::optional<std::size_t> flat_bytes() const noexcept override {
    return n_ * sizeof(T);
  }
  caf::error save(caf::serializer& sink) const override {
    std::uint64_t n = n_;
    if (auto err = sink(n)) return err;
    return sink.apply_raw(n * sizeof(T), const_cast<T*>(data_));
  }
  caf::error load(caf::deserializer&) override {
    return caf::make_error(caf::sec::state_not_serializable);
  }
  [[nodiscard]] std::shared_ptr<batch_base> slice(std::size_t from, std::size_t to) const override {
    return std::make_shared<batch_of<T>>(std::vector<T>(data_ + from, data_ + to));
  }
  [[nodiscard]] std::shared_ptr<batch_base> sub_view(std::size_t from,
                                                     std::size_t to) const override {
    return std::make_shared<batch_view<T>>(data_ + from, to - from, lease_);
  }

 private:
  const T* data_;
  std::size_t n_;
  std::shared_ptr<range_lease> lease_;
};

/// Creates empty batches of a registered item type when messages arrive from the network.
using batch_factory = std::function<std::unique_ptr<batch_base>()>;
void register_batch_type(const std::string& name, const std::type_info& type,
                         batch_factory factory);
/// The registered name of `type`, or "" when it is not registered.
std::string batch_type_name(const std::type_info& type);
std::unique_ptr<batch_base> make_batch(const std::string& name);

class batch;
/// `b` written in the wire format and read back, as a node would receive it (options::serialize,
/// testing::round_trip). Throws troupe::protocol_error naming `what` when its item type is not
/// registered (register_batch_type, TROUPE_REGISTER_JOB), fails to serialize or deserialize, or
/// reads back fewer bytes than it wrote.
batch round_trip_batch(const batch& b, const std::string& what);

/// Registers std::vector<T> batches under `name` (the same name in every process; by default
/// the type's mangled name, equal in programs built by the same compiler).
template <class T>
void register_batch_type(const std::string& name = typeid(T).name()) {
  static_assert(detail::wire_serializable<T>,
                "a batch type that crosses the network needs an inspect() overload (or to be a "
                "struct of plain data: trivially copyable, without padding)");
  register_batch_type(name, typeid(T), [] { return std::make_unique<batch_of<T>>(); });
}

/// Registers std::vector<T> batches under the default name unless T has a name already (from
/// TROUPE_REGISTER_JOB or a register_batch_type call of the user's, which it keeps).
template <class T>
void ensure_batch_type() {
  if (batch_type_name(typeid(T)).empty()) register_batch_type<T>();
}

class batch {
 public:
  batch() = default;
  explicit batch(std::shared_ptr<batch_base> ptr) : ptr_(std::move(ptr)) {}
  template <class T>
  static batch of(std::vector<T> items) {
    return batch{std::make_shared<batch_of<T>>(std::move(items))};
  }
  /// Items [data, data + n) that the batch does not own: a caller's range (see range_lease),
  /// or a buffer that outlives the batch (no lease).
  template <class T>
  static batch view(const T* data, std::size_t n, std::shared_ptr<range_lease> lease = nullptr) {
    return batch{std::make_shared<batch_view<T>>(data, n, std::move(lease))};
  }
  /// A lent range's lease, or nullptr for a batch that owns its items.
  [[nodiscard]] range_lease* lease() const noexcept { return ptr_ ? ptr_->lease() : nullptr; }
  /// A copy of items [from, to) that owns them. A part of a caller's range is read under its
  /// lease: nothing once the lease has been revoked (the job's handle took the range back).
  [[nodiscard]] std::optional<batch> owned_slice(std::size_t from, std::size_t to) const {
    auto* l = lease();
    if (l && !l->acquire()) return std::nullopt;
    struct releases {
      range_lease* l;
      ~releases() {
        if (l) l->release();
      }
    } held{l};
    return slice(from, to);
  }

  [[nodiscard]] std::size_t size() const noexcept { return ptr_ ? ptr_->size() : 0; }
  [[nodiscard]] bool empty() const noexcept { return size() == 0; }
  [[nodiscard]] explicit operator bool() const noexcept { return ptr_ != nullptr; }

  /// A copy of items [from, to).
  [[nodiscard]] batch slice(std::size_t from, std::size_t to) const {
    return ptr_ ? batch{ptr_->slice(from, to)} : batch{};
  }
  /// Items [from, to): a view of a view (a caller's lent range stays lent, nothing read), a
  /// copy of items the batch owns.
  [[nodiscard]] batch part(std::size_t from, std::size_t to) const {
    if (!ptr_) return batch{};
    if (auto v = ptr_->sub_view(from, to)) return batch{std::move(v)};
    return batch{ptr_->slice(from, to)};
  }
  /// A copy of these items followed by those of `other` (of the same type).
  [[nodiscard]] batch concat(const batch& other) const {
    if (!other.ptr_) return *this;
    return ptr_ ? batch{ptr_->concat(*other.ptr_)} : other;
  }

  /// The type-erased items (nullptr for no batch).
  [[nodiscard]] const batch_base* get() const noexcept { return ptr_.get(); }

  /// The items as T, or nullptr when the batch is empty-handed, holds another type, or views
  /// items it does not own (see span()).
  template <class T>
  [[nodiscard]] batch_of<T>* as() const noexcept {
    if (!ptr_ || ptr_->item_type() != typeid(T) || ptr_->view_data()) return nullptr;
    return static_cast<batch_of<T>*>(ptr_.get());
  }
  /// The items as a pointer and a count, whether owned or lent (numbers only); nullptr for
  /// another type.
  template <class T>
  [[nodiscard]] std::pair<const T*, std::size_t> span() const noexcept {
    if (!ptr_ || ptr_->item_type() != typeid(T)) return {nullptr, 0};
    if (ptr_->view_data()) {
      auto* v = static_cast<const batch_view<T>*>(ptr_.get());
      return {v->data(), v->size()};
    }
    auto* b = static_cast<const batch_of<T>*>(ptr_.get());
    return {b->items.data(), b->items.size()};
  }

  /// Network form: the registered type name, then the items ("-" for no batch).
  caf::error save_to(caf::serializer& sink) const;
  caf::error load_from(caf::deserializer& source);

  template <class Inspector>
  friend typename Inspector::result_type inspect(Inspector& f, batch& x) {
    if constexpr (std::is_base_of<caf::serializer, Inspector>::value) {
      return x.save_to(f);
    } else if constexpr (std::is_base_of<caf::deserializer, Inspector>::value) {
      return x.load_from(f);
    } else {
      std::size_t n = x.size();
      return f(caf::meta::type_name("troupe.batch"), n);
    }
  }

 private:
  std::shared_ptr<batch_base> ptr_;
};

}  // namespace troupe
