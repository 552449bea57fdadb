// What the benchmarks share to time their runs and print them: the clock, seconds since a point
// of it, and a rate, a duration and a share printed the same way everywhere.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace bench {

using clock_type = std::chrono::steady_clock;

/// Seconds from `t` until now.
inline double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

/// `items` in `seconds`, per second: "12.3 M/s" or "456.7 k/s" ("-" without time).
inline std::string rate(double items, double seconds) {
  if (seconds <= 0) return "-";
  char buf[64];
  double r = items / seconds;
  if (r >= 10e6)
    std::snprintf(buf, sizeof buf, "%.1f M/s", r / 1e6);
  else
    std::snprintf(buf, sizeof buf, "%.1f k/s", r / 1e3);
  return buf;
}

/// `seconds` in milliseconds: "12.3 ms" ("-" without time).
inline std::string ms(double seconds) {
  if (seconds <= 0) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f ms", seconds * 1e3);
  return buf;
}

/// anchor / troupe (times): troupe's speed as a share of the anchor's, "85 %".
inline std::string pct(double anchor, double troupe) {
  if (anchor <= 0 || troupe <= 0) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.0f %%", 100 * anchor / troupe);
  return buf;
}

}  // namespace bench
