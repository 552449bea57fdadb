// The ring all-reduce's data plane (ring_plane.hpp): rings' keys and the tests' switches.
#include <csignal>
#include <cstdlib>
#include <random>
#include <stdexcept>

#include "ring_plane.hpp"

namespace troupe::detail::ring_plane {

std::atomic<int> test_delay_ms{0};
std::atomic<int> test_fail_rings{0};

bool take_test_failure() noexcept {
  int left = test_fail_rings.load();
  while (left > 0 && !test_fail_rings.compare_exchange_weak(left, left - 1)) {
  }
  return left > 0;
}

void die_at_test_ring() noexcept {
  static const long at = [] {
    const char* v = std::getenv("TROUPE_TEST_DIE_AT_RING");
    return v != nullptr ? std::atol(v) : 0L;
  }();
  static std::atomic<long> started{0};
  if (at > 0 && ++started == at) ::raise(SIGKILL);
}

key random_key() {
  std::random_device rd;
  key k{};
  for (std::size_t i = 0; i < k.size(); i += 4) {
    auto v = rd();
    for (std::size_t j = 0; j < 4; ++j) k[i + j] = static_cast<std::uint8_t>(v >> (8 * j));
  }
  return k;
}

std::string to_hex(const key& k) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (auto b : k) {
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

key from_hex(const std::string& s) {
  if (s.size() != 32) throw std::invalid_argument("a ring key of the wrong length");
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw std::invalid_argument("a ring key that is not hex");
  };
  key k{};
  for (std::size_t i = 0; i < k.size(); ++i)
    k[i] = static_cast<std::uint8_t>(digit(s[2 * i]) * 16 + digit(s[2 * i + 1]));
  return k;
}

}  // namespace troupe::detail::ring_plane
