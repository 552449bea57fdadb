#include "troupe/internal/registry.hpp"

#include <algorithm>
#include <map>
#include <mutex>
#include <typeindex>

namespace troupe {
namespace {

struct job_registry {
  std::mutex mtx;
  std::map<std::string, registered_job> by_name;
  std::map<std::type_index, std::string> names;
};

job_registry& registry() {
  static job_registry instance;
  return instance;
}

}  // namespace

bool register_job(const std::string& name, const std::type_info& job, producer_spawner spawn,
                  std::string signature) {
  auto& r = registry();
  std::lock_guard<std::mutex> guard{r.mtx};
  r.by_name[name] = registered_job{std::move(spawn), std::move(signature)};
  r.names[std::type_index{job}] = name;
  return true;
}

registered_job find_job(const std::string& name) {
  auto& r = registry();
  std::lock_guard<std::mutex> guard{r.mtx};
  auto i = r.by_name.find(name);
  return i == r.by_name.end() ? registered_job{} : i->second;
}

std::string job_name(const std::type_info& job) {
  auto& r = registry();
  std::lock_guard<std::mutex> guard{r.mtx};
  auto i = r.names.find(std::type_index{job});
  return i == r.names.end() ? std::string{} : i->second;
}

std::vector<std::string> registered_jobs() {
  auto& r = registry();
  std::lock_guard<std::mutex> guard{r.mtx};
  std::vector<std::string> out;
  for (auto& [name, spawn] : r.by_name) out.push_back(name);
  return out;
}

}  // namespace troupe
