// A JSON string literal (quotes, backslashes and control characters escaped): for the trace
// file and the status page, which write their JSON by hand.
#pragma once

#include <cstdio>
#include <string>

namespace troupe::detail {

inline std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace troupe::detail
