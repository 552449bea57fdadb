// The names the membership tests (membership*_test.cpp) share.
#pragma once

#include <chrono>
#include <string>
#include <troupe/internal/membership.hpp>
#include <vector>

namespace {

using troupe::member;
using troupe::membership_event;
using troupe::detail::membership;
using clock_type = std::chrono::steady_clock;
using ms = std::chrono::milliseconds;

inline std::vector<troupe::device> devs(const std::string& a) {
  return {troupe::device{a + "/cpu"}};
}

}  // namespace
