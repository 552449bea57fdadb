// troupe::ordered_runner and troupe::unordered_runner: a pool of device-bound producers and a
// consumer, driven by a scheduler actor (API.md §2).
#pragma once

#include <caf/actor_system.hpp>
#include <initializer_list>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "troupe/config.hpp"
#include "troupe/detail/job_actors.hpp"
#include "troupe/detail/runtime.hpp"
#include "troupe/detail/source.hpp"
#include "troupe/device.hpp"
#include "troupe/generate.hpp"
#include "troupe/job.hpp"
#include "troupe/options.hpp"
#include "troupe/registry.hpp"

namespace troupe {

enum class ordering { unordered, ordered };

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
      : rt_(std::make_unique<detail::runtime>(std::move(devices), std::move(cfg), std::move(opts),
                                              job_name(typeid(Job)), &spawn_producer)) {}
  /// `cpu_producers` local CPU producers (easycore's Runner(devices=n)).
  explicit basic_runner(std::size_t cpu_producers, config cfg = {}, options opts = {})
      : basic_runner(cpus(cpu_producers), std::move(cfg), std::move(opts)) {}

  /// Runs every item of `inputs` (any input range, or troupe::generate(fn)) through the
  /// producers into a fresh consumer and returns consumer::end(). Inputs are pulled lazily.
  template <class InputRange>
  result_type run(InputRange&& inputs) {
    if (!rt_) throw runner_closed("run() on a moved-from runner");
    auto slot = std::make_shared<std::optional<result_type>>();
    rt_->run(
        detail::make_source<input_type>(inputs),
        [&slot](caf::actor_system& sys, const config& cfg) {
          return sys.spawn<caf::detached>(detail::consumer_actor<Job>, cfg, slot);
        },
        Order == ordering::ordered);
    return std::move(**slot);
  }
  result_type run(std::initializer_list<input_type> inputs) {
    return run<std::initializer_list<input_type>&>(inputs);
  }

  /// Ends the current run and every run() waiting for its turn (they throw runner_closed),
  /// then every producer (producer::end() runs on its thread), within options::close_timeout.
  /// Idempotent, safe from any thread. Called from on_progress or a job's own code, it starts
  /// closing and returns at once.
  void close() noexcept {
    if (rt_) rt_->close();
  }
  [[nodiscard]] bool is_open() const { return rt_ && rt_->is_open(); }
  [[nodiscard]] const std::vector<device>& devices() const noexcept {
    static const std::vector<device> none;
    return rt_ ? rt_->devices() : none;
  }
  [[nodiscard]] troupe::stats stats() const { return rt_ ? rt_->stats() : troupe::stats{}; }

 private:
  static caf::actor spawn_producer(caf::actor_system& sys, const device& d, const config& cfg) {
    return sys.spawn<caf::detached>(detail::producer_actor<Job>, d, cfg);
  }

  std::unique_ptr<detail::runtime> rt_;
};

/// The consumer sees outputs in input order.
template <class Job>
using ordered_runner = basic_runner<Job, ordering::ordered>;
/// The consumer sees outputs as they finish.
template <class Job>
using unordered_runner = basic_runner<Job, ordering::unordered>;

}  // namespace troupe
