// The input side of a run: pulls items from a range or generator into batches, lazily.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "troupe/batch.hpp"
#include "troupe/generate.hpp"

namespace troupe::detail {

class input_source {
 public:
  virtual ~input_source() = default;
  /// Up to max_items items (fewer once max_bytes is reached or the input ends). May throw
  /// whatever the user's range throws.
  virtual batch pull(std::size_t max_items, std::size_t max_bytes) = 0;
  [[nodiscard]] bool exhausted() const noexcept { return exhausted_; }
  [[nodiscard]] std::optional<std::uint64_t> total() const noexcept { return total_; }

 protected:
  bool exhausted_ = false;
  std::optional<std::uint64_t> total_;
};

template <class In, class Next>
batch fill(std::size_t max_items, std::size_t max_bytes, bool& exhausted, Next&& next) {
  std::vector<In> items;
  items.reserve(max_items < 1024 ? max_items : 1024);
  std::size_t bytes = 0;
  while (items.size() < max_items && bytes < max_bytes) {
    if (!next(items)) {
      exhausted = true;
      break;
    }
    if constexpr (sizeof(In) > 64 || has_nbytes<In>::value || is_contiguous_container<In>::value)
      bytes += payload_bytes(items.back());
  }
  return batch::of(std::move(items));
}

template <class In, class Range>
class range_source final : public input_source {
 public:
  explicit range_source(Range& r) : it_(std::begin(r)), end_(std::end(r)) {
    using iter = decltype(std::begin(r));
    if constexpr (std::is_base_of<std::forward_iterator_tag,
                                  typename std::iterator_traits<iter>::iterator_category>::value)
      total_ = static_cast<std::uint64_t>(std::distance(it_, end_));
  }
  batch pull(std::size_t max_items, std::size_t max_bytes) override {
    return fill<In>(max_items, max_bytes, exhausted_, [this](std::vector<In>& out) {
      if (it_ == end_) return false;
      out.emplace_back(*it_);
      ++it_;
      return true;
    });
  }

 private:
  decltype(std::begin(std::declval<Range&>())) it_;
  decltype(std::end(std::declval<Range&>())) end_;
};

template <class In, class F>
class generator_source final : public input_source {
 public:
  explicit generator_source(generator<F>& g) : g_(g) {}
  batch pull(std::size_t max_items, std::size_t max_bytes) override {
    return fill<In>(max_items, max_bytes, exhausted_, [this](std::vector<In>& out) {
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
std::shared_ptr<input_source> make_source(Range& r) {
  if constexpr (is_generator<std::remove_const_t<Range>>::value)
    return std::make_shared<generator_source<In, typename Range::function_type>>(r);
  else
    return std::make_shared<range_source<In, Range>>(r);
}

}  // namespace troupe::detail
