// troupe::ordered_runner and troupe::unordered_runner: a long-lived pool of device-bound
// producers shared by any number of jobs, each with its own consumer, driven by a scheduler
// actor (docs/api.md: "Runners" and "One pool, many jobs").
#pragma once

#include <caf/fwd.hpp>
#include <initializer_list>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "troupe/config.hpp"
#include "troupe/detail/job_ops.hpp"
#include "troupe/detail/runtime.hpp"
#include "troupe/detail/source.hpp"
#include "troupe/device.hpp"
#include "troupe/generate.hpp"
#include "troupe/job.hpp"
#include "troupe/job_handle.hpp"
#include "troupe/job_options.hpp"
#include "troupe/lend.hpp"
#include "troupe/node.hpp"
#include "troupe/options.hpp"

namespace troupe {

enum class ordering { unordered, ordered };

namespace detail {
/// runner.actor(): defined by <troupe/caf.hpp> (CAF headers stay out of this one).
template <class Runner>
struct caf_bridge;
}  // namespace detail

template <class Job, ordering Order>
class basic_runner {
 public:
  using traits = detail::job_traits<Job>;
  using input_type = typename traits::input_type;
  using output_type = typename traits::output_type;
  /// consumer::end()'s type, or std::vector<output_type> for a job without a consumer.
  using result_type = typename traits::result_type;

  /// Starts one producer per device entry; returns once every producer's constructor has run.
  explicit basic_runner(std::vector<device> devices, config cfg = {}, options opts = {})
      : rt_(std::move(devices), std::move(cfg), checked(std::move(opts)),
            detail::registered_job_name(typeid(Job)), &detail::make_producer_ops<Job>) {}
  /// The same on a CAF application's actor system (<troupe/caf.hpp>, troupe::add_to(cfg)):
  /// the jobs' consumers run on its threads, so one pool serves both. The runner must be
  /// closed (or destroyed) before the system.
  basic_runner(caf::actor_system& sys, std::vector<device> devices, config cfg = {},
               options opts = {})
      : rt_(sys, std::move(devices), std::move(cfg), checked(std::move(opts)),
            detail::registered_job_name(typeid(Job)), &detail::make_producer_ops<Job>) {}
  /// One producer per device of the cluster's members that are up, following the cluster while
  /// it runs (docs/api.md, "Pools that change"): a node that joins (cluster::add) or rejoins
  /// (restarted, cluster_options::reconnect) gets producers that take work in the running jobs;
  /// one drained by cluster::remove drains here (its chunks finish, end() runs); one lost is
  /// given up on at once (its chunks go elsewhere; its late answers are dropped). The runner
  /// keeps the cluster watching while it lives.
  explicit basic_runner(const cluster& c, config cfg = {}, options opts = {})
      : rt_(c, std::move(cfg), checked(std::move(opts)), detail::registered_job_name(typeid(Job)),
            &detail::make_producer_ops<Job>) {}
  /// A runner over a core made elsewhere (troupe::testing::simulation's simulated clusters).
  explicit basic_runner(detail::runtime_handle rt) : rt_(std::move(rt)) {}
  /// `cpu_producers` local CPU producers (easycore's Runner(devices=n)).
  explicit basic_runner(std::size_t cpu_producers, config cfg = {}, options opts = {})
      : basic_runner(cpus(cpu_producers), std::move(cfg), std::move(opts)) {}

  /// Starts a job: every item of `inputs` (any input range, or troupe::generate(fn)) through
  /// the producers into a fresh consumer, next to the jobs already running. Returns at once.
  /// An lvalue range is copied into the job (it may die at once), an rvalue one (a temporary,
  /// a generator) moved into it; troupe::lend(xs) reads `xs` in place instead (no copy; it must
  /// outlive the job). Inputs are pulled lazily, on the scheduler's thread.
  template <class InputRange>
  job_handle<result_type> submit(InputRange&& inputs, job_options o = {}) {
    auto slot = std::make_shared<std::optional<result_type>>();
    auto core = rt_.submit(detail::make_job_source<input_type>(std::forward<InputRange>(inputs)),
                           detail::make_consumer_maker<Job>(slot), Order == ordering::ordered,
                           std::move(o), traits::folds);
    return job_handle<result_type>{std::move(core), std::move(slot)};
  }
  job_handle<result_type> submit(std::initializer_list<input_type> inputs, job_options o = {}) {
    return submit(std::vector<input_type>(inputs), std::move(o));
  }

  /// submit(inputs, o).get(): runs every item of `inputs` and returns consumer::end() (or the
  /// outputs, for a job without consumer). Other threads' jobs run at the same time.
  template <class InputRange>
  result_type run(InputRange&& inputs, job_options o = {}) {
    // run() outlives the job: the range is read in place
    if constexpr (detail::is_lent<std::remove_cv_t<std::remove_reference_t<InputRange>>>::value)
      return submit(inputs, std::move(o)).get();
    else
      return submit(troupe::lend(inputs), std::move(o)).get();
  }
  result_type run(std::initializer_list<input_type> inputs, job_options o = {}) {
    return submit(inputs, std::move(o)).get();
  }

  /// The outputs as they come (in input order on an ordered runner), through a bounded buffer:
  /// a slow reader pauses the producers. Leaving the loop early cancels the rest of the job.
  /// The job's consumer is not used. `inputs` as for submit(): an lvalue is copied,
  /// troupe::lend(xs) is read in place.
  template <class InputRange>
  output_stream<output_type> stream(InputRange&& inputs, job_options o = {}) {
    auto buf = std::make_shared<detail::stream_buffer>(stream_buffer_chunks);
    auto core =
        rt_.submit_stream(detail::make_job_source<input_type>(std::forward<InputRange>(inputs)),
                          buf, Order == ordering::ordered, std::move(o));
    return output_stream<output_type>{std::move(core), std::move(buf)};
  }
  output_stream<output_type> stream(std::initializer_list<input_type> inputs, job_options o = {}) {
    return stream(std::vector<input_type>(inputs), std::move(o));
  }

  /// Ends every job still running (their get() throws runner_closed), then every producer
  /// (producer::end() runs on its thread), within options::close_timeout. Idempotent, safe from any
  /// thread. Called from on_progress or a job's own code, it starts closing and returns at once.
  void close() noexcept { rt_.close(); }

  /// Starts producers on `devices` while jobs run: they take work within one chunk (the
  /// running jobs too). Returns once they are constructed; throws for the new devices only
  /// (device_unavailable, init_error, node_error; invalid_argument for a node's device on a
  /// runner built over local devices only, or on troupe's own threads), runner_closed after
  /// close(). Their slots (producer_stats::index) follow the existing ones.
  void add_devices(std::vector<device> devices) { rt_.add_devices(std::move(devices)); }
  /// Drains one producer per entry (the first present one on that device): it takes no new
  /// work, its chunks in flight finish (their outputs are delivered), producer::end() runs (at
  /// most options::close_timeout, else it is left behind); returns when they are gone. Nothing
  /// is lost or delivered twice; ordered jobs stay ordered. invalid_argument for a device not
  /// present, or when no producer would be left (close() instead); then nothing is removed.
  void remove_devices(std::vector<device> devices) { rt_.remove_devices(std::move(devices)); }
  [[nodiscard]] bool is_open() const { return rt_.is_open(); }
  /// The devices of the producers present now: a snapshot that stays valid (and unchanged)
  /// until 64 later changes of the producers present (add_devices, remove_devices, nodes that
  /// join or leave), so that a long-lived runner does not keep every list it ever showed; call
  /// again after a change, copy it to keep it.
  [[nodiscard]] const std::vector<device>& devices() const noexcept { return rt_.devices(); }
  [[nodiscard]] troupe::stats stats() const { return rt_.stats(); }

  /// The CAF actor system its actors run on (the application's, or troupe's own).
  [[nodiscard]] caf::actor_system& system() const { return rt_.system(); }
  /// A CAF actor that answers (troupe::submit_atom::value, std::vector<input_type>) with the
  /// job's result (result_type) or an error (troupe's code: troupe::error_code(err)); each
  /// request is a job on this runner. Needs <troupe/caf.hpp>. Ended when the runner closes.
  template <class Self = basic_runner>
  typename detail::caf_bridge<Self>::actor_type actor() {
    auto a = detail::caf_bridge<Self>::make(rt_.guarded_submitter(), rt_.system());
    rt_.own(a);
    return a;
  }

 private:
  /// Chunks a stream keeps for its reader (each at most options::max_chunk_bytes).
  static constexpr std::size_t stream_buffer_chunks = 4;

  static options checked(options o) {
    if (o.serialize) detail::register_wire_types<Job>();
    return o;
  }
  detail::runtime_handle rt_;
};

/// The consumer sees outputs in input order.
template <class Job>
using ordered_runner = basic_runner<Job, ordering::ordered>;
/// The consumer sees outputs as they finish.
template <class Job>
using unordered_runner = basic_runner<Job, ordering::unordered>;

}  // namespace troupe
