// troupe::span<T>: a view of contiguous items, what a batch producer's work() takes (C++17:
// std::span is C++20; troupe::span converts from and to nothing else but pointer and size).
#pragma once

#include <cstddef>
#include <stdexcept>
#include <type_traits>

namespace troupe {

template <class T>
class span {
 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;
  using size_type = std::size_t;
  using iterator = T*;

  constexpr span() noexcept = default;
  constexpr span(T* data, std::size_t size) noexcept : data_(data), size_(size) {}

  [[nodiscard]] constexpr T* data() const noexcept { return data_; }
  [[nodiscard]] constexpr std::size_t size() const noexcept { return size_; }
  [[nodiscard]] constexpr bool empty() const noexcept { return size_ == 0; }
  constexpr T& operator[](std::size_t i) const noexcept { return data_[i]; }
  [[nodiscard]] T& at(std::size_t i) const {
    if (i >= size_) throw std::out_of_range("troupe::span::at");
    return data_[i];
  }
  [[nodiscard]] constexpr T& front() const noexcept { return data_[0]; }
  [[nodiscard]] constexpr T& back() const noexcept { return data_[size_ - 1]; }
  [[nodiscard]] constexpr T* begin() const noexcept { return data_; }
  [[nodiscard]] constexpr T* end() const noexcept { return data_ + size_; }
  /// Items [offset, offset + count).
  [[nodiscard]] constexpr span subspan(std::size_t offset, std::size_t count) const noexcept {
    return span{data_ + offset, count};
  }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

template <class T>
struct is_span : std::false_type {};
template <class T>
struct is_span<span<T>> : std::true_type {};

}  // namespace troupe
