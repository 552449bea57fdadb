// troupe::generate(fn): an input made by calling fn() until it returns std::nullopt.
#pragma once

#include <optional>
#include <type_traits>
#include <utility>

namespace troupe {

template <class F>
class generator {
 public:
  using optional_type = std::decay_t<std::invoke_result_t<F&>>;
  using value_type = typename optional_type::value_type;
  static_assert(std::is_same<optional_type, std::optional<value_type>>::value,
                "troupe::generate(fn): fn must return std::optional<T>");

  using function_type = F;
  explicit generator(F fn) : fn_(std::move(fn)) {}
  /// The next item, or std::nullopt at the end of the input.
  optional_type next() { return fn_(); }

 private:
  F fn_;
};

template <class F>
generator<std::decay_t<F>> generate(F&& fn) {
  return generator<std::decay_t<F>>{std::forward<F>(fn)};
}

template <class T>
struct is_generator : std::false_type {};
template <class F>
struct is_generator<generator<F>> : std::true_type {};

}  // namespace troupe
