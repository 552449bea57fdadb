// A project outside troupe's tree, built against the installed package (core only).
#include <cstdint>
#include <fstream>
#include <iostream>
#include <string>
#include <troupe/troupe.hpp>

struct squares {
  struct producer {
    std::int64_t work(std::int64_t x) { return x * x; }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

int main() {
  std::int64_t result = 0;
  {
    troupe::unordered_runner<squares> runner{2};
    result = runner.run({1, 2, 3});
  }
  std::ifstream status{"/proc/self/status"};
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0)
      std::cout << "peak RSS: " << std::stoll(line.substr(6)) << " KiB\n";
  std::cout << "result: " << result << "\n";
}
