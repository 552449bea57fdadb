// The registry of jobs a program can run on behalf of remote coordinators. A node only spawns
// producers of jobs registered here (TROUPE_REGISTER_JOB, <troupe/register.hpp>).
#pragma once

#include <caf/actor.hpp>
#include <caf/fwd.hpp>
#include <cstddef>
#include <functional>
#include <string>
#include <typeinfo>
#include <vector>

#include "troupe/config.hpp"
#include "troupe/device.hpp"

namespace troupe {

/// Spawns a job's producer actor on a local device (not yet constructed: it answers init_atom;
/// for a training job, a replica actor); the index is its place in the runner's (or the
/// coordinator's) device list. The one name for "make a producer actor": producer_maker
/// (job_ops.hpp) makes the job's producer object inside it.
using producer_spawner =
    std::function<caf::actor(caf::actor_system&, const device&, const config&, std::size_t)>;

struct registered_job {
  producer_spawner spawn;  ///< empty when no job has the name
  /// "INPUT -> OUTPUT" batch type names: a coordinator and a node must agree on them.
  std::string signature;
};

/// Registers `job` under `name`; returns true (for static registration).
bool register_job(const std::string& name, const std::type_info& job, producer_spawner spawn,
                  std::string signature);

/// The job registered under `name` (an empty `spawn` when there is none).
registered_job find_job(const std::string& name);

/// The registered name of `job`, or "" when it is not registered.
std::string job_name(const std::type_info& job);

/// Every registered job name, sorted.
std::vector<std::string> registered_jobs();

}  // namespace troupe
