// The two clocks the echo floors read (echo_floor.cpp, caf_echo_floor.cpp): this process's CPU
// (user + system, every thread) and the monotonic wall clock, in seconds.
#pragma once

#include <sys/resource.h>

#include <ctime>

inline double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

inline double now_seconds() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) / 1e9;
}
