// The core of a runner (private to the library): its producers, its scheduler actor, and the
// rules for submit() and close() across threads. Runners reach it through the functions of
// <troupe/detail/runtime.hpp>.
#pragma once

#include <atomic>
#include <caf/actor.hpp>
#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/fwd.hpp>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "planted_bug.hpp"
#include "stats_box.hpp"
#include "troupe/config.hpp"
#include "troupe/detail/introspect.hpp"
#include "troupe/detail/job_core.hpp"
#include "troupe/detail/job_ops.hpp"
#include "troupe/detail/network.hpp"
#include "troupe/detail/runtime.hpp"
#include "troupe/detail/source.hpp"
#include "troupe/device.hpp"
#include "troupe/internal/registry.hpp"
#include "troupe/node.hpp"
#include "troupe/options.hpp"

namespace troupe::detail {

/// One job, handed from the caller's thread to the scheduler actor.
struct job_spec {
  std::shared_ptr<job_core> core;
  std::shared_ptr<input_source> source;
  caf::actor consumer;
  bool ordered = false;
  job_options opts;
  bool fold = false;  ///< its consumer has merge() (job_traits::folds)
};

/// add_devices: producers constructed already, for the scheduler's slots from `first` on.
struct producers_added {
  std::vector<caf::actor> actors;
  std::vector<device> where;
  std::vector<caf::actor> nodes;  ///< a node producer's node actor (its chunks' trims)
  std::size_t first = 0;
  std::shared_ptr<std::promise<void>> done;  ///< set once the scheduler has them
};

/// remove_devices: slots to drain; `done` is set once they are retired.
struct drain_spec {
  std::vector<std::size_t> slots;
  std::shared_ptr<std::promise<void>> done;
};

/// How errors name entry `i` of a runner's devices: "cpu (producer 2)".
inline std::string entry_name(const std::vector<device>& devices, std::size_t i) {
  return devices[i].str() + " (producer " + std::to_string(i) + ")";
}

/// The checks of a runner's and a job's options (invalid_argument naming the option).
void validate(const options& o);
void validate(const job_options& o);

/// The actor system every local-only runner of this process shares. It is never destroyed:
/// a producer stuck inside a native call can be left behind without blocking anything, and no
/// thread that once used a runner can make a destructor wait.
caf::actor_system& local_system();

/// A simulated cluster, as a runtime sees it (actors/src/simulation.cpp).
class sim_host {
 public:
  virtual ~sim_host() = default;
  /// The simulation's actor system (CAF's test coordinator: one thread, virtual time).
  virtual caf::actor_system& system() = 0;
  /// Spawns the simulated producer of device `d` (entry `index` of a runner's devices);
  /// `serialize`: options::serialize.
  virtual caf::actor spawn_producer(producer_maker make, const device& d, const config& cfg,
                                    std::size_t index, bool serialize) = 0;
  /// Runs the simulation until `until()` holds, nothing more can happen, or `at_most` of virtual
  /// time has passed.
  virtual void drive(const std::function<bool()>& until,
                     std::chrono::nanoseconds at_most = std::chrono::nanoseconds::max()) = 0;
  /// An actor of a runner (its scheduler) that ends with the simulation.
  virtual void own(caf::actor a) = 0;
  /// Set when the simulation ends: its schedulers do nothing more but end.
  virtual std::shared_ptr<std::atomic<bool>> halted() = 0;
  /// The mistake tests plant in this simulation's schedulers (sim_access::plant): none but
  /// there.
  [[nodiscard]] virtual planted_bug planted() const { return planted_bug::none; }
  /// Makes `job` a job of this simulation: its waits run the simulation.
  virtual void adopt(const std::shared_ptr<job_core>& job) = 0;
};

class runtime_follower;

/// The owner of a runner's producers on nodes (runtime_anchor.cpp): they live as long as it
/// does. It takes the scheduler (a caf::actor message) and forwards a draining node's
/// leaving_atom to it, keeping one that comes before the scheduler exists.
caf::behavior anchor_actor(caf::event_based_actor* self, int);

class runtime {
 public:
  using consumer_spawner =
      std::function<caf::actor(caf::actor_system&, const std::shared_ptr<job_gate>&)>;

  /// Starts one producer per device and waits until each has been constructed.
  /// Throws invalid_argument, device_unavailable or init_error.
  /// `job`: the job's registered name ("" if none), needed for remote devices.
  runtime(std::vector<device> devices, config cfg, options opts, std::string job,
          producer_maker make, caf::actor_system* app = nullptr);
  /// The same on a simulated cluster (no waiting: the simulation runs instead).
  runtime(std::shared_ptr<sim_host> sim, std::vector<device> devices, config cfg, options opts,
          producer_maker make);
  ~runtime();
  runtime(const runtime&) = delete;
  runtime& operator=(const runtime&) = delete;

  /// Starts a job: `source` through the producers into a fresh consumer (spawned here), next
  /// to the jobs already running. Throws runner_closed after close(), invalid_argument for bad
  /// options. `fold`: local producers may fold the outputs for the consumer's merge().
  std::shared_ptr<job_core> submit(std::shared_ptr<input_source> source,
                                   const consumer_spawner& spawn, bool ordered, job_options o,
                                   bool fold = false);
  /// Ends every job (runner_closed), then the producers. From troupe's own threads
  /// (on_progress, a job's code) it only starts closing and returns.
  void close() noexcept;
  [[nodiscard]] bool is_open() const;
  /// The devices of the producers present now (a snapshot: it stays valid and unchanged for
  /// the next 64 changes; call again after add_devices / remove_devices or a loss). A producer
  /// the scheduler lost or removed since the last list is left out here, on the caller's thread.
  [[nodiscard]] const std::vector<device>& devices() const noexcept;
  /// The list as last published, without looking for losses (under membership_).
  [[nodiscard]] const std::vector<device>& published() const noexcept { return *current_.load(); }
  /// Starts producers on `devices` (waits until constructed) and hands them to the scheduler;
  /// they take work at once. Throws for the new devices only (invalid_argument,
  /// device_unavailable, init_error, node_error), runner_closed after close().
  void add_devices(const std::vector<device>& devices);
  /// Drains producers on `devices` (one producer per entry, the first present one on that
  /// device): no new work, their chunks finish, producer::end() runs; returns when they are
  /// gone. invalid_argument for a device that is not present or when none would be left.
  void remove_devices(const std::vector<device>& devices);
  [[nodiscard]] const config& job_config() const noexcept { return cfg_; }
  [[nodiscard]] troupe::stats stats() const;
  /// For observers (runner_snapshots).
  [[nodiscard]] runner_snapshot snapshot() const;
  [[nodiscard]] caf::actor_system& system() const { return *sys_; }
  /// Lets actors submit to this runtime until it closes (runtime_handle::guarded_submitter).
  struct submit_gate {
    std::mutex mtx;
    runtime* rt = nullptr;  ///< null once closed
  };
  [[nodiscard]] std::shared_ptr<submit_gate> gate() const { return gate_; }
  void own(caf::actor a);

  // -- following a cluster (runtime_follow.cpp) --
  /// Follows `c` from now on: `f` was registered with it before this runtime was built (from
  /// the snapshot's devices); the changes it heard meanwhile are applied now.
  void follow(std::shared_ptr<cluster_state> c, std::shared_ptr<runtime_follower> f);
  /// A member joined or rejoined: producers on its devices (a fresh connection to it).
  void join_node(const std::string& node, const std::vector<device>& devices);
  /// A member drains: its present producers drain (returns when they are gone).
  void leave_node(const std::string& node);
  /// A member was given up on: its producers are lost now (their late answers dropped).
  void fence_node(const std::string& node);
  /// Stops following (waits for a change being applied). Idempotent.
  void unfollow() noexcept;
  /// Whether every present producer is on `node`.
  [[nodiscard]] bool only_on(const std::string& node);

 private:
  /// This runner among those runner_snapshots() lists (from construction to destruction).
  void enlist();
  /// A submitted job, for snapshot()'s running jobs (under mtx_).
  void watch(const std::shared_ptr<job_core>& core);
  void delist();
  /// Spawns one producer per device: locally, or through the device's node.
  std::vector<caf::actor> spawn_all(const std::string& job, const tls& settings);
  /// The checks every runtime makes of its devices and options; one stats entry per device.
  void check_and_count();
  /// close() of a simulated runtime: the simulation runs until the scheduler has closed.
  void close_simulated() noexcept;
  /// Ends actors that started before the runner failed to start (and the anchor of remote
  /// producers with them, unless `keep_anchor`: add_devices, while the others run).
  void abandon(const std::vector<caf::actor>& started, bool keep_anchor = false) noexcept;
  /// A producer on node device `d` (slot `i`), spawned through its node (anchor_ its owner).
  caf::actor spawn_remote(const device& d, std::size_t i);
  /// The node actor of each device on a node (null for a local one): where trims go.
  std::vector<caf::actor> node_actors(const std::vector<device>& ds);
  /// Asks `spawned` (for devices `ds`, slots from `first`) to construct their job objects;
  /// throws the first failure after ending every one of them.
  void init_all(const std::vector<caf::actor>& spawned, const std::vector<device>& ds,
                std::size_t first, bool keep_anchor);
  /// Spawns simulated producers for `ds` (slots from `first`) and runs the simulation until
  /// each has constructed its job object; throws the first failure (init_error, node_error,
  /// testing::hang) after ending them all.
  std::vector<caf::actor> start_simulated(const std::vector<device>& ds, std::size_t first);
  /// The checks before add_devices / remove_devices (not on troupe's threads, not closed);
  /// holds membership_ for the change.
  std::unique_lock<std::mutex> begin_change(const char* what);
  /// Waits for `f` (a simulated runner: runs the simulation until it is ready).
  void await(std::future<void>& f);
  /// Per slot: whether its producer is still there (not removed, not lost for good).
  [[nodiscard]] std::vector<bool> present() const;
  /// Makes devices() the present slots' devices.
  void publish();

  std::vector<device> devices_;  ///< as constructed
  /// Every slot's device (constructed, then added); present() says which are still there.
  std::vector<device> slots_;
  /// The devices() lists handed out, the latest kept_snapshots of them (a reference to one
  /// stays valid until that many newer ones exist).
  std::deque<std::vector<device>> published_;
  static constexpr std::size_t kept_snapshots = 64;
  std::atomic<const std::vector<device>*> current_{nullptr};
  /// stats_box::presence when the list was last published.
  std::atomic<std::uint64_t> published_presence_{0};
  std::mutex membership_;  ///< one add_devices / remove_devices at a time (taken before mtx_)
  std::string job_;        ///< the registered name, for producers on nodes
  tls tls_;
  bool network_ = false;  ///< sys_ is the network system: node devices may be added
  std::map<std::string, caf::actor> nodes_;
  /// Connecting to a node and its answer to a spawn (the cluster's connect_timeout for both,
  /// once following one).
  node_deadlines deadlines_;
  config cfg_;
  options opts_;
  producer_spawner spawn_;
  caf::actor_system* sys_ = nullptr;  ///< local_system(), or the process's network system

  mutable std::mutex mtx_;  ///< guards the fields below; never held while waiting on actors
  bool open_ = false;
  std::uint64_t next_job_ = 1;
  std::shared_future<void> closed_;  ///< set once the scheduler has ended the producers

  /// Jobs submitted, for snapshot()'s running jobs: ended and dropped ones are pruned when
  /// the list doubles (amortized by submit()).
  std::vector<std::weak_ptr<job_core>> watched_;
  std::size_t prune_watched_at_ = 64;

  caf::actor scheduler_;
  caf::actor anchor_;  ///< owner of remote producers; nodes end them when it is gone
  std::shared_ptr<stats_box> stats_;
  std::shared_ptr<sim_host> sim_;  ///< a simulated cluster, else null
  std::uint64_t observed_id_ = 0;  ///< runner_snapshot::id, 0 until enlisted
  std::shared_ptr<submit_gate> gate_ = std::make_shared<submit_gate>();
  std::vector<caf::actor> owned_;               ///< runner.actor()s, ended at close (under mtx_)
  std::shared_ptr<cluster_state> cluster_;      ///< the cluster it follows, if any
  std::shared_ptr<runtime_follower> follower_;  ///< its place among the cluster's followers
};

/// Spawns the scheduler actor of a runtime (actors/src/scheduler_actor.cpp). `spawn` and `cfg`
/// start replacements for local producers that were given up on.
/// `detached`: on a thread of its own (runners); false for the deterministic scheduler tests
/// and simulations, which run it on CAF's test coordinator. `halted`: once true, it does
/// nothing more but end (a simulation that ends while a job still runs: nothing of that job,
/// its caller's range included, may be touched again). `nodes`: each producer's node actor
/// (trims), by slot. `planted`: a mistake a test plants in it (a simulation's: planted_bug).
caf::actor spawn_scheduler(caf::actor_system& sys, std::vector<caf::actor> producers,
                           std::vector<device> devices, options opts,
                           std::shared_ptr<stats_box> stats, producer_spawner spawn, config cfg,
                           bool detached = true,
                           std::shared_ptr<std::atomic<bool>> halted = nullptr,
                           std::vector<caf::actor> nodes = {},
                           planted_bug planted = planted_bug::none);

}  // namespace troupe::detail

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<troupe::detail::job_spec>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<troupe::detail::producers_added>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<troupe::detail::drain_spec>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<std::promise<void>>)
