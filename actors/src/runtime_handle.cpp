// runtime_handle: what the runner templates hold (troupe/detail/runtime.hpp): a runtime, built
// over devices, on an application's actor system or in a simulation, and its forwarding calls.
#include <caf/actor_system.hpp>

#include "runtime_impl.hpp"
#include "troupe/detail/job_actors.hpp"
#include "troupe/error.hpp"

namespace troupe::detail {

runtime_handle::runtime_handle(std::vector<device> devices, config cfg, options opts,
                               std::string job, producer_maker make)
    : impl_(std::make_unique<runtime>(std::move(devices), std::move(cfg), std::move(opts),
                                      std::move(job), make)) {}
runtime_handle::runtime_handle(caf::actor_system& sys, std::vector<device> devices, config cfg,
                               options opts, std::string job, producer_maker make)
    : impl_(std::make_unique<runtime>(std::move(devices), std::move(cfg), std::move(opts),
                                      std::move(job), make, &sys)) {}
runtime_handle::runtime_handle(std::shared_ptr<sim_host> sim, std::vector<device> devices,
                               config cfg, options opts, producer_maker make)
    : impl_(std::make_unique<runtime>(std::move(sim), std::move(devices), std::move(cfg),
                                      std::move(opts), make)) {}
runtime_handle::runtime_handle(runtime_handle&&) noexcept = default;
runtime_handle& runtime_handle::operator=(runtime_handle&&) noexcept = default;
runtime_handle::~runtime_handle() = default;

runtime& runtime_handle::checked() const {
  if (!impl_) throw runner_closed("a moved-from runner");
  return *impl_;
}

std::shared_ptr<job_core> runtime_handle::submit(std::shared_ptr<input_source> source,
                                                 consumer_maker make, bool ordered, job_options o,
                                                 bool fold) {
  auto& rt = checked();
  return rt.submit(
      std::move(source),
      [&make, &rt](caf::actor_system& sys, const std::shared_ptr<job_gate>& gate) {
        return spawn_consumer_actor(sys, std::move(make), rt.job_config(), gate);
      },
      ordered, std::move(o), fold);
}

std::shared_ptr<job_core> runtime_handle::submit_stream(std::shared_ptr<input_source> source,
                                                        std::shared_ptr<stream_buffer> buf,
                                                        bool ordered, job_options o) {
  auto core = checked().submit(
      std::move(source),
      [&buf](caf::actor_system& sys, const std::shared_ptr<job_gate>& gate) {
        return spawn_stream_consumer(sys, buf, gate);
      },
      ordered, std::move(o));
  core->on_finish([buf] { buf->notify(); });
  return core;
}

void runtime_handle::close() noexcept {
  if (impl_) impl_->close();
}

bool runtime_handle::is_open() const {
  return impl_ && impl_->is_open();
}

const std::vector<device>& runtime_handle::devices() const noexcept {
  static const std::vector<device> none;
  return impl_ ? impl_->devices() : none;
}

troupe::stats runtime_handle::stats() const {
  return impl_ ? impl_->stats() : troupe::stats{};
}

}  // namespace troupe::detail
