// Small helpers shared by the test files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

namespace test_util {

/// 0, 1, ..., n-1
inline std::vector<std::int64_t> iota(std::int64_t n) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

/// The sum of x*x over iota(n).
inline std::int64_t sum_of_squares(std::int64_t n) {
  std::int64_t s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += i * i;
  return s;
}

/// This process's peak resident memory (VmHWM), KiB.
inline std::size_t peak_rss_kib() {
  std::ifstream status{"/proc/self/status"};
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoul(line.substr(6));
  return 0;
}

}  // namespace test_util
