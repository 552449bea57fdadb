// troupe::device: where a producer runs. "cpu", "cuda", "cuda:N", or on a remote node
// "HOST:PORT/cpu", "HOST:PORT/cuda:N".
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace troupe {

class device {
 public:
  /// Parses `spec`; throws troupe::invalid_argument quoting it when malformed.
  device(const char* spec);         // NOLINT: implicit on purpose, {"cpu", "cuda:0"} works
  device(const std::string& spec);  // NOLINT
  device() : device("cpu") {}

  [[nodiscard]] bool is_cpu() const noexcept { return kind_ == kind::cpu; }
  [[nodiscard]] bool is_cuda() const noexcept { return kind_ == kind::cuda; }
  /// The device index, -1 when none was given.
  [[nodiscard]] int index() const noexcept { return index_; }
  /// "HOST:PORT" of the node that owns the device; "" for this process.
  [[nodiscard]] const std::string& node() const noexcept { return node_; }
  [[nodiscard]] bool is_local() const noexcept { return node_.empty(); }
  /// The same device without its node part ("cuda:1" for "h:1/cuda:1").
  [[nodiscard]] device local() const;
  /// A spec that parses back to an equal device.
  [[nodiscard]] std::string str() const;

  friend bool operator==(const device& a, const device& b) noexcept {
    return a.kind_ == b.kind_ && a.index_ == b.index_ && a.node_ == b.node_;
  }
  friend bool operator!=(const device& a, const device& b) noexcept { return !(a == b); }

  template <class Inspector>
  friend typename Inspector::result_type inspect(Inspector& f, device& x) {
    return f(x.kind_, x.index_, x.node_);  // (no CAF header here: the core's parts use it)
  }

 private:
  enum kind : int { cpu = 0, cuda = 1 };
  void parse(const std::string& spec);
  int kind_ = kind::cpu;
  int index_ = -1;
  std::string node_;
};

std::string to_string(const device& d);

/// `n` local CPU devices (easycore's Runner(devices=n)).
std::vector<device> cpus(std::size_t n);

/// Every usable local GPU, as cuda:0 ... cuda:N-1; empty when there is no GPU, no driver, or
/// troupe was built without CUDA. Never throws for a missing driver.
std::vector<device> gpus();

/// Why `d` cannot be used in this process, or "" when it can.
std::string why_unavailable(const device& d);

}  // namespace troupe
