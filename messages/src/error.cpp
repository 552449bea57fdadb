#include "troupe/error.hpp"

namespace troupe {

const char* to_string(errc code) noexcept {
  switch (code) {
    case errc::none:
      return "none";
    case errc::invalid_argument:
      return "invalid_argument";
    case errc::device_unavailable:
      return "device_unavailable";
    case errc::init_error:
      return "init_error";
    case errc::work_error:
      return "work_error";
    case errc::consumer_error:
      return "consumer_error";
    case errc::runner_closed:
      return "runner_closed";
    case errc::config_error:
      return "config_error";
    case errc::node_error:
      return "node_error";
    case errc::protocol_error:
      return "protocol_error";
    case errc::cancelled:
      return "cancelled";
    case errc::deadline_exceeded:
      return "deadline_exceeded";
  }
  return "unknown";
}

void throw_error(errc code, const std::string& what) {
  switch (code) {
    case errc::invalid_argument:
      throw invalid_argument(what);
    case errc::device_unavailable:
      throw device_unavailable(what);
    case errc::init_error:
      throw init_error(what);
    case errc::work_error:
      throw work_error(what, 0, "");
    case errc::consumer_error:
      throw consumer_error(what);
    case errc::runner_closed:
      throw runner_closed(what);
    case errc::config_error:
      throw config_error(what);
    case errc::node_error:
      throw node_error(what);
    case errc::cancelled:
      throw cancelled(what);
    case errc::deadline_exceeded:
      throw deadline_exceeded(what);
    case errc::none:
    case errc::protocol_error:
      break;
  }
  throw protocol_error(what);
}

}  // namespace troupe
