#include "troupe/config.hpp"

#include <caf/config_value.hpp>
#include <limits>

#include "troupe/error.hpp"

namespace troupe {
namespace {

const caf::config_value* find(const caf::settings& values, const std::string& key) {
  return caf::get_if(&values, key);
}

[[noreturn]] void wrong_type(const std::string& key, const caf::config_value& v, const char* want) {
  throw config_error("config key '" + key + "' holds " + caf::to_string(v) + ", which is not " +
                     want + ": set it with the right type or read it with get<T> of its type");
}

template <class T>
T convert(const std::string& key, const caf::config_value& v);

template <class T>
T convert_integer(const std::string& key, const caf::config_value& v) {
  auto p = caf::get_if<caf::config_value::integer>(&v);
  if (p == nullptr) wrong_type(key, v, "an integer");
  auto x = *p;
  if constexpr (std::is_unsigned<T>::value) {
    if (x < 0 || static_cast<std::uint64_t>(x) > std::numeric_limits<T>::max())
      wrong_type(key, v, "in range of the requested unsigned type");
  } else {
    if (x < std::numeric_limits<T>::min() || x > std::numeric_limits<T>::max())
      wrong_type(key, v, "in range of the requested integer type");
  }
  return static_cast<T>(x);
}

template <class T>
T convert_scalar(const std::string& key, const caf::config_value& v) {
  if constexpr (std::is_same<T, bool>::value) {
    auto p = caf::get_if<bool>(&v);
    if (p == nullptr) wrong_type(key, v, "a bool");
    return *p;
  } else if constexpr (std::is_integral<T>::value) {
    return convert_integer<T>(key, v);
  } else if constexpr (std::is_floating_point<T>::value) {
    if (auto p = caf::get_if<caf::config_value::real>(&v)) return static_cast<T>(*p);
    if (auto p = caf::get_if<caf::config_value::integer>(&v)) return static_cast<T>(*p);
    wrong_type(key, v, "a number");
  } else {
    static_assert(std::is_same<T, std::string>::value, "unsupported config type");
    auto p = caf::get_if<std::string>(&v);
    if (p == nullptr) wrong_type(key, v, "a string");
    return *p;
  }
}

template <class T>
struct converter {
  static T apply(const std::string& key, const caf::config_value& v) {
    return convert_scalar<T>(key, v);
  }
};

template <class T>
struct converter<std::vector<T>> {
  static std::vector<T> apply(const std::string& key, const caf::config_value& v) {
    auto p = caf::get_if<caf::config_value::list>(&v);
    if (p == nullptr) wrong_type(key, v, "a list");
    std::vector<T> out;
    out.reserve(p->size());
    for (auto& element : *p) out.push_back(convert_scalar<T>(key, element));
    return out;
  }
};

template <>
struct converter<config> {
  static config apply(const std::string& key, const caf::config_value& v) {
    auto p = caf::get_if<caf::settings>(&v);
    if (p == nullptr) wrong_type(key, v, "a table");
    return config{*p};
  }
};

template <class T>
caf::config_value::list to_list(const std::vector<T>& xs) {
  caf::config_value::list out;
  for (const auto& x : xs) {
    if constexpr (std::is_same<T, bool>::value)
      out.emplace_back(static_cast<bool>(x));
    else
      out.emplace_back(x);
  }
  return out;
}

}  // namespace

config& config::set(const std::string& key, bool value) {
  caf::put(values_, key, value);
  return *this;
}
config& config::set(const std::string& key, double value) {
  caf::put(values_, key, value);
  return *this;
}
config& config::set(const std::string& key, const char* value) {
  return set(key, std::string{value});
}
config& config::set(const std::string& key, std::string value) {
  caf::put(values_, key, std::move(value));
  return *this;
}
config& config::set(const std::string& key, const std::vector<bool>& value) {
  caf::put(values_, key, to_list(value));
  return *this;
}
config& config::set(const std::string& key, const std::vector<double>& value) {
  caf::put(values_, key, to_list(value));
  return *this;
}
config& config::set(const std::string& key, const std::vector<std::string>& value) {
  caf::put(values_, key, to_list(value));
  return *this;
}
void config::too_large(const std::string& key, std::uint64_t value) {
  throw config_error("config key '" + key + "': " + std::to_string(value) +
                     " is above the largest integer a config holds (INT64_MAX)");
}

config& config::set_integer(const std::string& key, std::int64_t value) {
  caf::put(values_, key, value);
  return *this;
}
config& config::set_integers(const std::string& key, std::vector<std::int64_t> value) {
  caf::put(values_, key, to_list(value));
  return *this;
}

bool config::contains(const std::string& key) const {
  return find(values_, key) != nullptr;
}

template <class T>
T config::get(const std::string& key) const {
  auto v = find(values_, key);
  if (v == nullptr)
    throw config_error("config has no key '" + key + "': set it with config::set(\"" + key +
                       "\", ...) or read it with get_or");
  return converter<T>::apply(key, *v);
}

#define TROUPE_CONFIG_GET(T)                               \
  template T config::get<T>(const std::string& key) const; \
  template std::vector<T> config::get<std::vector<T>>(const std::string& key) const;

TROUPE_CONFIG_GET(bool)
TROUPE_CONFIG_GET(char)
TROUPE_CONFIG_GET(signed char)
TROUPE_CONFIG_GET(unsigned char)
TROUPE_CONFIG_GET(short)
TROUPE_CONFIG_GET(unsigned short)
TROUPE_CONFIG_GET(int)
TROUPE_CONFIG_GET(unsigned int)
TROUPE_CONFIG_GET(long)
TROUPE_CONFIG_GET(unsigned long)
TROUPE_CONFIG_GET(long long)
TROUPE_CONFIG_GET(unsigned long long)
TROUPE_CONFIG_GET(float)
TROUPE_CONFIG_GET(double)
TROUPE_CONFIG_GET(std::string)
template config config::get<config>(const std::string& key) const;

#undef TROUPE_CONFIG_GET

}  // namespace troupe
