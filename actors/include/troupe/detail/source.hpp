// The input side of a run: pulls items from a range or generator into batches, lazily.
#pragma once

#include <algorithm>
#include <caf/detail/serialized_size.hpp>
#include <caf/detail/type_traits.hpp>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "troupe/batch.hpp"
#include "troupe/generate.hpp"
#include "troupe/lend.hpp"

namespace troupe::detail {

template <class T, class = void>
struct has_troupe_size : std::false_type {};
template <class T>
struct has_troupe_size<T, std::void_t<decltype(troupe_size(std::declval<const T&>()))>>
    : std::true_type {};

/// `double troupe_cost(const T&)`, found by argument-dependent lookup: how heavy an item is,
/// relative to others of its type (docs/api.md, "Item costs: troupe_cost").
template <class T, class = void>
struct has_troupe_cost : std::false_type {};
template <class T>
struct has_troupe_cost<T, std::void_t<decltype(troupe_cost(std::declval<const T&>()))>>
    : std::true_type {};

/// An item's troupe_cost, at least 0 (a NaN or negative cost counts as 0).
template <class T>
double item_cost(const T& x) {
  auto c = static_cast<double>(troupe_cost(x));
  return c > 0 ? c : 0.0;
}

/// A cost of item_cost() relative to `scale`, the first positive finite cost the job's source
/// met (set by it), and at most 1e15 unless infinite: a chunk's total then stays finite whatever
/// the costs' magnitude (two items of 1e308 add up to infinity), and the scheduler counts at most
/// a billion of its units an item anyway.
inline double relative_cost(double c, double& scale) {
  if (c == 0 || std::isinf(c)) return c;
  if (scale == 0) scale = c;
  return std::min(c / scale, 1e15);
}

template <class T, class = void>
struct is_range : std::false_type {};
template <class T>
struct is_range<T, std::void_t<decltype(std::begin(std::declval<const T&>())),
                               decltype(std::end(std::declval<const T&>())),
                               decltype(std::declval<const T&>().size())>> : std::true_type {};

/// What an item of a type troupe cannot measure (not trivially copyable, no troupe_size(), no
/// inspect(), not a container) is taken to hold: it may own heap memory of any size.
constexpr std::size_t unknown_item_bytes = 16 * 1024;

/// The bytes an item holds, for the memory bound (options::max_chunk_bytes): a user's
/// `std::size_t troupe_size(const T&)` (found by argument-dependent lookup) when there is one;
/// else numbers and tensors exactly, containers by their elements (recursively), types with an
/// inspect() overload by their serialized size, trivially copyable types by sizeof, and
/// anything else as unknown_item_bytes.
template <class T>
std::size_t item_bytes(const T& x) {
  if constexpr (has_troupe_size<T>::value) {
    return static_cast<std::size_t>(troupe_size(x));
  } else if constexpr (std::is_arithmetic<T>::value) {
    return sizeof(T);
  } else if constexpr (has_nbytes<T>::value) {
    return sizeof(T) + static_cast<std::size_t>(x.nbytes());
  } else if constexpr (is_range<T>::value) {
    using value = std::decay_t<decltype(*std::begin(x))>;
    if constexpr (std::is_arithmetic<value>::value) {
      return sizeof(T) + x.size() * sizeof(value);
    } else {
      std::size_t n = sizeof(T);
      for (const auto& e : x) n += item_bytes(e);
      return n;
    }
  } else if constexpr (caf::detail::is_inspectable<caf::serializer, T>::value) {
    caf::detail::serialized_size_inspector f{nullptr};
    f(const_cast<T&>(x));
    return sizeof(T) + f.result();
  } else if constexpr (std::is_trivially_copyable<T>::value) {
    return sizeof(T);  // owns nothing on the heap
  } else {
    return std::max(sizeof(T), unknown_item_bytes);
  }
}

class input_source {
 public:
  virtual ~input_source() = default;
  /// Up to max_items items: fewer once they hold max_bytes, once pulling them has taken
  /// `budget` (a slow source must not hold back a chunk, and the outputs behind it), or when the
  /// input ends. May throw whatever the user's range throws.
  virtual batch pull(std::size_t max_items, std::size_t max_bytes,
                     std::chrono::nanoseconds budget) = 0;
  [[nodiscard]] bool exhausted() const noexcept { return exhausted_; }
  /// Whether the items have troupe_cost(): chunks are then cut by their total cost too.
  [[nodiscard]] bool costed() const noexcept { return costed_; }
  /// The next pull() stops once its items cost this much in all (the item that crosses it
  /// included); infinity: no bound.
  void limit_cost(double c) noexcept { cost_limit_ = c; }
  /// The total troupe_cost of the items the last pull() returned, relative to the first
  /// positive finite cost the source met (so is limit_cost's bound: relative_cost).
  [[nodiscard]] double last_cost() const noexcept { return last_cost_; }
  [[nodiscard]] std::optional<std::uint64_t> total() const noexcept { return total_; }
  /// The lease of a caller's range lent to the producers without a copy, else nullptr.
  [[nodiscard]] const std::shared_ptr<range_lease>& lease() const noexcept { return lease_; }

 protected:
  bool exhausted_ = false;
  bool costed_ = false;
  double cost_limit_ = std::numeric_limits<double>::infinity();
  double last_cost_ = 0;
  double cost_scale_ = 0;  ///< relative_cost's scale: 0 until an item of positive cost came
  std::optional<std::uint64_t> total_;
  std::shared_ptr<range_lease> lease_;
};

/// Up to max_items items from `next`: fewer once they hold max_bytes, once they cost max_cost
/// in all (troupe_cost relative to `scale`: relative_cost; their total in `cost`), once pulling
/// has taken `budget`, or when `next` has no more (`exhausted`).
template <class In, class Next>
batch fill(std::size_t max_items, std::size_t max_bytes, std::chrono::nanoseconds budget,
           bool& exhausted, double max_cost, double& cost, double& scale, Next&& next) {
  cost = 0;
  using clock = std::chrono::steady_clock;
  std::vector<In> items;
  std::size_t bytes = 0;
  if constexpr (std::is_arithmetic<In>::value) {
    // Numbers: the byte bound is a count, and the chunk's room is reserved once (growing a
    // vector item by item costs more than pulling the items), up to a million items (a chunk
    // size of SIZE_MAX asked for more memory than there is, whatever the job's length).
    max_items = std::min(max_items, std::max<std::size_t>(1, max_bytes / sizeof(In)));
    items.reserve(std::min(max_items, std::size_t{1} << 20));
    max_bytes = std::numeric_limits<std::size_t>::max();
  } else {
    items.reserve(max_items < 1024 ? max_items : 1024);
  }
  auto start = clock::now();
  std::size_t check_every = 1;  // a power of two: the clock is read after every item at first,
  while (items.size() < max_items && bytes < max_bytes) {  // then every 256th
    if (!next(items)) {
      exhausted = true;
      break;
    }
    if constexpr (!std::is_arithmetic<In>::value) bytes += item_bytes(items.back());
    if constexpr (has_troupe_cost<In>::value) {
      cost += relative_cost(item_cost(items.back()), scale);
      if (cost >= max_cost) break;
    }
    auto n = items.size();
    if ((n & (check_every - 1)) == 0) {
      if (clock::now() - start >= budget) break;
      if (n >= 16 * check_every && check_every < 256) check_every *= 2;
    }
  }
  return batch::of(std::move(items));
}

/// A contiguous range of numbers of the job's input type (a std::vector, std::array, C array):
/// lent to the producers without a copy when the caller keeps it alive.
template <class In, class Range, class = void>
struct lendable : std::false_type {};
template <class In, class Range>
struct lendable<In, Range, std::void_t<decltype(std::data(std::declval<Range&>()))>>
    : std::bool_constant<
          raw_items<In> &&
          std::is_same<
              std::remove_cv_t<std::remove_pointer_t<decltype(std::data(std::declval<Range&>()))>>,
              In>::value> {};

template <class In, class Range>
class range_source final : public input_source {
 public:
  /// `lend`: hand out parts of a contiguous range of numbers instead of copies (the caller
  /// keeps it alive until the job's handle has revoked the lease).
  explicit range_source(Range& r, bool lend = false) : it_(std::begin(r)), end_(std::end(r)) {
    costed_ = has_troupe_cost<In>::value;
    using iter = decltype(std::begin(r));
    if constexpr (std::is_base_of<std::forward_iterator_tag,
                                  typename std::iterator_traits<iter>::iterator_category>::value)
      total_ = static_cast<std::uint64_t>(std::distance(it_, end_));
    if constexpr (lendable<In, Range>::value) {
      if (lend) {
        data_ = std::data(r);
        size_ = static_cast<std::size_t>(std::distance(it_, end_));
        lease_ = std::make_shared<range_lease>();
        exhausted_ = size_ == 0;
      }
    }
  }
  batch pull(std::size_t max_items, std::size_t max_bytes,
             std::chrono::nanoseconds budget) override {
    if constexpr (lendable<In, Range>::value) {
      if (lease_) {
        auto n =
            std::min({max_items, std::max<std::size_t>(1, max_bytes / sizeof(In)), size_ - next_});
        auto b = batch::view(data_ + next_, n, lease_);
        next_ += n;
        exhausted_ = next_ == size_;
        return b;
      }
    }
    auto b = fill<In>(max_items, max_bytes, budget, exhausted_, cost_limit_, last_cost_,
                      cost_scale_, [this](std::vector<In>& out) {
                        if (it_ == end_) return false;
                        out.emplace_back(*it_);
                        ++it_;
                        return true;
                      });
    if (it_ == end_) exhausted_ = true;  // known now: the last chunk can say so
    return b;
  }

 private:
  decltype(std::begin(std::declval<Range&>())) it_;
  decltype(std::end(std::declval<Range&>())) end_;
  const In* data_ = nullptr;  ///< lent: the caller's items
  std::size_t size_ = 0;
  std::size_t next_ = 0;
};

template <class In, class F>
class generator_source final : public input_source {
 public:
  explicit generator_source(generator<F>& g) : g_(g) { costed_ = has_troupe_cost<In>::value; }
  batch pull(std::size_t max_items, std::size_t max_bytes,
             std::chrono::nanoseconds budget) override {
    return fill<In>(max_items, max_bytes, budget, exhausted_, cost_limit_, last_cost_, cost_scale_,
                    [this](std::vector<In>& out) {
                      auto x = g_.next();
                      if (!x) return false;
                      out.emplace_back(std::move(*x));
                      return true;
                    });
  }

 private:
  generator<F>& g_;
};

template <class In, class Range>
std::shared_ptr<input_source> make_source(Range& r, bool lend = false) {
  if constexpr (is_generator<std::remove_const_t<Range>>::value)
    return std::make_shared<generator_source<In, typename Range::function_type>>(r);
  else
    return std::make_shared<range_source<In, Range>>(r, lend);
}

/// A source that owns its range (a range or generator handed to submit() as an rvalue).
template <class In, class Range>
class owning_source final : public input_source {
 public:
  explicit owning_source(Range&& r) : range_(std::move(r)), inner_(make_source<In>(range_)) {
    total_ = inner_->total();
    costed_ = inner_->costed();
  }
  batch pull(std::size_t max_items, std::size_t max_bytes,
             std::chrono::nanoseconds budget) override {
    inner_->limit_cost(cost_limit_);
    auto b = inner_->pull(max_items, max_bytes, budget);
    exhausted_ = inner_->exhausted();
    last_cost_ = inner_->last_cost();
    return b;
  }

 private:
  Range range_;
  std::shared_ptr<input_source> inner_;
};

template <class T>
struct is_lent : std::false_type {};
template <class Range>
struct is_lent<lent<Range>> : std::true_type {};

/// A copy of an lvalue range that the job owns: the same type where it can be copied, else
/// (a C array, a view that cannot be copied) a vector of its elements.
template <class Range>
auto copy_of(const Range& r) {
  using plain = std::remove_cv_t<std::remove_reference_t<Range>>;
  if constexpr (!std::is_array_v<plain> && std::is_copy_constructible_v<plain>) {
    return plain(r);
  } else {
    static_assert(!is_generator<plain>::value,
                  "submit(g) copies an lvalue generator, and this one cannot be copied: "
                  "submit(std::move(g)) or submit(troupe::lend(g))");
    using value = std::remove_cv_t<std::remove_reference_t<decltype(*std::begin(r))>>;
    return std::vector<value>(std::begin(r), std::end(r));
  }
}

/// For submit(): a range lent with troupe::lend() is read in place (it must outlive the job; a
/// contiguous range of numbers is lent to the producers until the job's handle has returned
/// it); an rvalue is moved into the job, an lvalue copied into it (as std::async would), so
/// the caller's range may die at once.
template <class In, class Range>
std::shared_ptr<input_source> make_job_source(Range&& r) {
  using plain = std::remove_cv_t<std::remove_reference_t<Range>>;
  if constexpr (is_lent<plain>::value) {
    return make_source<In>(r.range(), true);
  } else if constexpr (std::is_lvalue_reference<Range>::value) {
    auto copy = copy_of(r);
    return std::make_shared<owning_source<In, decltype(copy)>>(std::move(copy));
  } else {
    return std::make_shared<owning_source<In, plain>>(std::move(r));
  }
}

}  // namespace troupe::detail
