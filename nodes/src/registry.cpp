#include "troupe/internal/registry.hpp"

#include "troupe/internal/named_registry.hpp"

namespace troupe {
namespace {

detail::named_registry<registered_job>& registry() {
  // Never destroyed: actor and network threads may still look jobs up while exit() runs.
  static auto& instance = *new detail::named_registry<registered_job>;
  return instance;
}

}  // namespace

bool register_job(const std::string& name, const std::type_info& job, producer_spawner spawn,
                  std::string signature) {
  registry().add(name, job, registered_job{std::move(spawn), std::move(signature)});
  return true;
}

registered_job find_job(const std::string& name) {
  return registry().find(name);
}

std::string job_name(const std::type_info& job) {
  return registry().name_of(job);
}

std::vector<std::string> registered_jobs() {
  return registry().names();
}

}  // namespace troupe
