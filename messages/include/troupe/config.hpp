// troupe::config: the job's configuration (easycore's `cfg`). Copied to every producer and to
// the consumer; serializable, so it can travel to remote nodes. Keys with dots nest:
// set("model.width", 64) creates the table "model" with the entry "width".
#pragma once

#include <caf/settings.hpp>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace troupe {

class config {
 public:
  config() = default;
  /// Wraps existing CAF settings (e.g. a nested table).
  explicit config(caf::settings values) : values_(std::move(values)) {}

  config& set(const std::string& key, bool value);
  config& set(const std::string& key, double value);
  config& set(const std::string& key, const char* value);
  config& set(const std::string& key, std::string value);
  config& set(const std::string& key, const std::vector<bool>& value);
  config& set(const std::string& key, const std::vector<double>& value);
  config& set(const std::string& key, const std::vector<std::string>& value);
  /// Integers are stored as int64: an unsigned value above INT64_MAX throws config_error.
  template <class Int, class = std::enable_if_t<std::is_integral<Int>::value>>
  config& set(const std::string& key, Int value) {
    return set_integer(key, checked(key, value));
  }
  template <class Int, class = std::enable_if_t<std::is_integral<Int>::value>>
  config& set(const std::string& key, const std::vector<Int>& value) {
    std::vector<std::int64_t> xs;
    xs.reserve(value.size());
    for (auto x : value) xs.push_back(checked(key, x));
    return set_integers(key, std::move(xs));
  }

  /// Returns the value at `key` converted to T. Throws troupe::config_error when the key is
  /// missing or holds another type (or an integer out of T's range).
  /// T: bool, any integer, float, double, std::string, std::vector of those, or config
  /// (a nested table).
  template <class T>
  [[nodiscard]] T get(const std::string& key) const;

  /// Like get(), but returns `fallback` when the key is missing (a wrong type still throws).
  template <class T>
  [[nodiscard]] T get_or(const std::string& key, T fallback) const {
    return contains(key) ? get<T>(key) : fallback;
  }

  [[nodiscard]] bool contains(const std::string& key) const;
  [[nodiscard]] bool empty() const { return values_.empty(); }

  /// The underlying CAF settings (serializable with CAF's inspectors).
  [[nodiscard]] const caf::settings& settings() const { return values_; }

  friend bool operator==(const config& a, const config& b) { return a.values_ == b.values_; }

  template <class Inspector>
  friend typename Inspector::result_type inspect(Inspector& f, config& x) {
    return f(caf::meta::type_name("troupe.config"), x.values_);
  }

 private:
  template <class Int>
  static std::int64_t checked(const std::string& key, Int value) {
    if constexpr (std::is_unsigned<Int>::value && sizeof(Int) >= sizeof(std::int64_t))
      if (value > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        too_large(key, static_cast<std::uint64_t>(value));
    return static_cast<std::int64_t>(value);
  }
  [[noreturn]] static void too_large(const std::string& key, std::uint64_t value);
  config& set_integer(const std::string& key, std::int64_t value);
  config& set_integers(const std::string& key, std::vector<std::int64_t> value);
  caf::settings values_;
};

}  // namespace troupe
