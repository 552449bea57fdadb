#include "troupe/error.hpp"

namespace troupe {

const char* to_string(errc code) noexcept {
  switch (code) {
    case errc::none:
      return "none";
#define TROUPE_DETAIL_NAME(name, simple) \
  case errc::name:                       \
    return #name;
      TROUPE_ERROR_CODES(TROUPE_DETAIL_NAME)
#undef TROUPE_DETAIL_NAME
  }
  return "unknown";
}

namespace {
template <class E>
[[noreturn]] void throw_as(const std::string& what) {
  throw E(what);
}
template <>
[[noreturn]] void throw_as<work_error>(const std::string& what) {
  throw work_error(what, 0, "");
}
}  // namespace

void throw_error(errc code, const std::string& what) {
  switch (code) {
#define TROUPE_DETAIL_THROW(name, simple) \
  case errc::name:                        \
    throw_as<name>(what);
    TROUPE_ERROR_CODES(TROUPE_DETAIL_THROW)
#undef TROUPE_DETAIL_THROW
    case errc::none:
      break;
  }
  throw protocol_error(what);
}

}  // namespace troupe
