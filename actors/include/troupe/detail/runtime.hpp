// What a runner template needs of its compiled core (actors/src/runtime_impl.hpp): create it,
// hand it jobs, close it. No CAF actor headers here: they stay in the library.
#pragma once

#include <caf/fwd.hpp>
#include <functional>
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

#include "troupe/config.hpp"
#include "troupe/detail/job_core.hpp"
#include "troupe/detail/job_ops.hpp"
#include "troupe/detail/source.hpp"
#include "troupe/device.hpp"
#include "troupe/job_options.hpp"
#include "troupe/options.hpp"

namespace troupe {
class cluster;
}

namespace troupe::detail {

/// True on a thread that runs troupe's actors (producers, consumers, the scheduler and so
/// on_progress): a runner's blocking members must not wait there for those same actors.
bool on_internal_thread() noexcept;
/// Marks the calling thread as one of troupe's (set by the actors before running user code).
void mark_internal_thread() noexcept;
/// Forgets that mark (for tests that run troupe's actors on their own thread).
void clear_internal_thread() noexcept;

/// The name `job` was registered under (TROUPE_REGISTER_JOB), or "".
std::string registered_job_name(const std::type_info& job);

class runtime;   // actors/src/runtime_impl.hpp
class sim_host;  // a simulated cluster (troupe::testing::simulation, actors/src/simulation.cpp)

/// A runner's compiled core, behind a pointer to its implementation: the producers, the
/// scheduler, the jobs. What a runner template calls; no CAF actor header here.
class runtime_handle {
 public:
  /// Starts one producer per device (objects made by `make`) and waits until each has been
  /// constructed. Throws invalid_argument, device_unavailable or init_error. `job`: the job's
  /// registered name ("" if none), needed for remote devices.
  runtime_handle(std::vector<device> devices, config cfg, options opts, std::string job,
                 producer_maker make);
  /// The same on an application's actor system (<troupe/caf.hpp>): consumers run on its
  /// threads; producers and the scheduler on threads of their own, as always.
  runtime_handle(caf::actor_system& sys, std::vector<device> devices, config cfg, options opts,
                 std::string job, producer_maker make);
  /// The same over a live cluster's members, following it: joined and rejoined nodes get
  /// producers, draining ones drain, lost ones are given up on (runtime_follow.cpp).
  runtime_handle(const cluster& c, config cfg, options opts, std::string job, producer_maker make);
  /// The same on a simulated cluster: simulated producers, the scheduler on the simulation's
  /// thread, in virtual time; waits run the simulation (troupe::testing::simulation).
  runtime_handle(std::shared_ptr<sim_host> sim, std::vector<device> devices, config cfg,
                 options opts, producer_maker make);
  runtime_handle(runtime_handle&&) noexcept;
  runtime_handle& operator=(runtime_handle&&) noexcept;
  ~runtime_handle();

  /// Starts a job: `source` through the producers into a fresh consumer made by `make`, next to
  /// the jobs already running. Throws runner_closed after close() (or when moved from),
  /// invalid_argument for bad options. `fold`: the consumer has merge() (job_traits::folds).
  std::shared_ptr<job_core> submit(std::shared_ptr<input_source> source, consumer_maker make,
                                   bool ordered, job_options o, bool fold = false);
  /// The same with a stream's bounded buffer in place of a consumer.
  std::shared_ptr<job_core> submit_stream(std::shared_ptr<input_source> source,
                                          std::shared_ptr<stream_buffer> buf, bool ordered,
                                          job_options o);
  /// Ends every job (runner_closed), then the producers. Idempotent.
  void close() noexcept;
  /// Producers on more devices, while jobs run (runner::add_devices).
  void add_devices(std::vector<device> devices);
  /// Drains producers (runner::remove_devices).
  void remove_devices(std::vector<device> devices);
  [[nodiscard]] bool is_open() const;
  [[nodiscard]] const std::vector<device>& devices() const noexcept;
  [[nodiscard]] troupe::stats stats() const;

  /// The actor system the runner's actors run on.
  [[nodiscard]] caf::actor_system& system() const;
  using submitter = std::function<std::shared_ptr<job_core>(
      std::shared_ptr<input_source>, consumer_maker, bool ordered, job_options, bool fold)>;
  /// submit() for actors that outlive this handle's moves (runner.actor()): once the runner has
  /// closed (or is gone) it throws runner_closed instead of touching it.
  [[nodiscard]] submitter guarded_submitter() const;
  /// An actor of the runner's (runner.actor()): ended when the runner closes.
  void own(caf::actor a);

 private:
  runtime& checked() const;
  std::unique_ptr<runtime> impl_;
};

}  // namespace troupe::detail
