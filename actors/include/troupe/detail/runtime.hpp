// The non-template core of a runner: its actor system, its producers, its scheduler actor.
#pragma once

#include <caf/actor.hpp>
#include <caf/fwd.hpp>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <vector>

#include "troupe/config.hpp"
#include "troupe/detail/source.hpp"
#include "troupe/device.hpp"
#include "troupe/node.hpp"
#include "troupe/options.hpp"

namespace troupe::detail {

/// One run, handed from the caller's thread to the scheduler actor.
struct run_spec {
  std::uint64_t id = 0;
  std::shared_ptr<input_source> source;
  caf::actor consumer;
  bool ordered = false;
  std::promise<void> done;  ///< fulfilled by the scheduler; holds the run's exception
};

/// Statistics shared between the scheduler and the caller.
struct stats_box {
  std::mutex mtx;
  troupe::stats value;
};

class runtime {
 public:
  using producer_spawner =
      std::function<caf::actor(caf::actor_system&, const device&, const config&)>;
  using consumer_spawner = std::function<caf::actor(caf::actor_system&, const config&)>;

  /// Starts one producer per device and waits until each has been constructed.
  /// Throws invalid_argument, device_unavailable or init_error.
  /// `job`: the job's registered name ("" if none), needed for remote devices.
  runtime(std::vector<device> devices, config cfg, options opts, std::string job,
          const producer_spawner& spawn);
  ~runtime();
  runtime(const runtime&) = delete;
  runtime& operator=(const runtime&) = delete;

  /// Runs `source` through the producers into a fresh consumer. Blocks; serialized.
  void run(std::shared_ptr<input_source> source, const consumer_spawner& spawn, bool ordered);
  void close() noexcept;
  [[nodiscard]] bool is_open() const;
  [[nodiscard]] const std::vector<device>& devices() const noexcept { return devices_; }
  [[nodiscard]] troupe::stats stats() const;

 private:
  void shutdown(std::vector<caf::actor> started) noexcept;
  /// Spawns one producer per device: locally, or through the device's node.
  std::vector<caf::actor> spawn_all(const std::string& job, const tls& settings,
                                    const producer_spawner& spawn);

  std::vector<device> devices_;
  config cfg_;
  options opts_;
  mutable std::mutex mtx_;  ///< serializes run() and close()
  bool open_ = false;
  std::uint64_t next_run_ = 1;
  std::unique_ptr<caf::actor_system_config> sys_cfg_;
  std::unique_ptr<caf::actor_system> own_sys_;  ///< a local-only runner's own system
  caf::actor_system* sys_ = nullptr;            ///< own_sys_, or the process's network system
  std::vector<caf::actor> producers_;
  caf::actor scheduler_;
  caf::actor anchor_;  ///< owner of remote producers; nodes end them when it is gone
  std::shared_ptr<stats_box> stats_;
};

/// Spawns the scheduler actor of a runtime (actors/src/scheduler_actor.cpp).
caf::actor spawn_scheduler(caf::actor_system& sys, std::vector<caf::actor> producers,
                           std::vector<device> devices, options opts,
                           std::shared_ptr<stats_box> stats);

}  // namespace troupe::detail
