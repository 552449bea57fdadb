#include "troupe/device.hpp"

#include <cctype>

#include "troupe/device_binding.hpp"
#include "troupe/error.hpp"

namespace troupe {
namespace {

[[noreturn]] void malformed(const std::string& spec, const char* why) {
  throw invalid_argument("malformed device spec '" + spec + "': " + why +
                         " (expected cpu, cuda, cuda:N, HOST:PORT/cpu or HOST:PORT/cuda:N)");
}

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

}  // namespace

device::device(const char* spec) {
  if (spec == nullptr) throw invalid_argument("malformed device spec: null pointer");
  parse(spec);
}

device::device(const std::string& spec) {
  parse(spec);
}

void device::parse(const std::string& spec) {
  std::string local = spec;
  if (auto slash = spec.find('/'); slash != std::string::npos) {
    node_ = spec.substr(0, slash);
    local = spec.substr(slash + 1);
    auto colon = node_.rfind(':');
    if (colon == std::string::npos || colon == 0 || !all_digits(node_.substr(colon + 1)))
      malformed(spec, "the node part must be HOST:PORT");
    auto port = node_.substr(colon + 1);
    // More than five digits is out of range too (and std::stoul would throw out_of_range).
    if (port.size() > 5 || std::stoul(port) > 65535) malformed(spec, "port out of range");
  }
  std::string name = local;
  std::string number;
  if (auto colon = local.find(':'); colon != std::string::npos) {
    name = local.substr(0, colon);
    number = local.substr(colon + 1);
    if (!all_digits(number) || number.size() > 4) malformed(spec, "the index must be a number");
    index_ = std::stoi(number);
  }
  if (name == "cpu") {
    kind_ = kind::cpu;
  } else if (name == "cuda") {
    kind_ = kind::cuda;
  } else {
    malformed(spec, "unknown device type");
  }
}

device device::local() const {
  device d = *this;
  d.node_.clear();
  return d;
}

std::string device::str() const {
  std::string out = node_;
  if (!out.empty()) out += '/';
  out += kind_ == kind::cpu ? "cpu" : "cuda";
  if (index_ >= 0) {
    out += ':';
    out += std::to_string(index_);
  }
  return out;
}

std::string to_string(const device& d) {
  return d.str();
}

std::vector<device> cpus(std::size_t n) {
  return std::vector<device>(n, device{"cpu"});
}

std::vector<device> gpus() {
  std::vector<device> out;
  int count = detail::cuda_device_count();
  for (int i = 0; i < count; ++i) out.emplace_back("cuda:" + std::to_string(i));
  return out;
}

std::string why_unavailable(const device& d) {
  if (!d.is_local()) return {};  // its node decides
  if (d.is_cpu()) return {};
  int count = detail::cuda_device_count();
  if (count < 0)
    return "device " + d.str() +
           ": this program has no CUDA support (link troupe::torch, built with a CUDA "
           "LibTorch and the CUDA toolkit); use cpu devices";
  auto n = static_cast<std::size_t>(count);
  if (n == 0)
    return "device " + d.str() +
           ": no usable GPU in this process (no GPU, or no NVIDIA "
           "driver); use cpu devices or troupe::gpus()";
  if (d.index() >= static_cast<int>(n))
    return "device " + d.str() + ": only " + std::to_string(n) +
           " GPU(s) here (cuda:0 to cuda:" + std::to_string(n - 1) + ")";
  return {};
}

}  // namespace troupe
