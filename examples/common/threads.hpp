// The process's thread count (Linux: /proc/self/status), for programs that show that waiting
// for many requests adds no thread.
#pragma once

#include <fstream>
#include <string>

namespace example {

inline int threads_now() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  return -1;
}

}  // namespace example
