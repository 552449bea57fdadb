// A process-wide table of things registered under a name and a C++ type (batch types, jobs):
// thread-safe, filled by static initializers, read while messages are (de)serialized. The one
// shape both of troupe's registries share.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <typeindex>
#include <typeinfo>
#include <unordered_map>
#include <vector>

namespace troupe::detail {

template <class Value>
class named_registry {
 public:
  /// Registers `value` under `name` for `type` (a later registration of the name replaces it).
  void add(const std::string& name, const std::type_info& type, Value value) {
    std::lock_guard<std::mutex> guard{mtx_};
    by_name_[name] = std::move(value);
    names_[std::type_index{type}] = name;
  }
  /// The value registered under `name`, or a default-constructed one.
  [[nodiscard]] Value find(const std::string& name) const {
    std::lock_guard<std::mutex> guard{mtx_};
    auto i = by_name_.find(name);
    return i == by_name_.end() ? Value{} : i->second;
  }
  /// The name `type` was registered under, or "".
  [[nodiscard]] std::string name_of(const std::type_info& type) const {
    std::lock_guard<std::mutex> guard{mtx_};
    auto i = names_.find(std::type_index{type});
    return i == names_.end() ? std::string{} : i->second;
  }
  /// Every registered name, sorted.
  [[nodiscard]] std::vector<std::string> names() const {
    std::lock_guard<std::mutex> guard{mtx_};
    std::vector<std::string> out;
    for (auto& [name, value] : by_name_) out.push_back(name);
    return out;
  }

 private:
  mutable std::mutex mtx_;
  std::map<std::string, Value> by_name_;
  std::unordered_map<std::type_index, std::string> names_;
};

}  // namespace troupe::detail
