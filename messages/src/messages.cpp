#include <caf/message.hpp>

#include "troupe/protocol.hpp"

namespace troupe {

namespace {
constexpr auto category = caf::atom("troupe");
}

caf::error make_error(errc code, std::string what) {
  return caf::error{static_cast<std::uint8_t>(code), category, caf::make_message(std::move(what))};
}

errc error_code(const caf::error& err) {
  if (!err) return errc::none;
  if (err.category() != category) return errc::node_error;
  return static_cast<errc>(err.code());
}

std::string error_text(const caf::error& err) {
  if (err.category() == category && err.context().match_elements<std::string>())
    return err.context().get_as<std::string>(0);
  return caf::to_string(err);
}

}  // namespace troupe
