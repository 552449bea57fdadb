// A runner inside an application (docs/api.md, "troupe inside a CAF application"): its actor
// system, submitting from actors that may outlive the runner's handle (runner.actor()), and the
// actors it owns.
#include <caf/actor_system.hpp>
#include <caf/send.hpp>

#include "runtime_impl.hpp"
#include "troupe/detail/job_actors.hpp"
#include "troupe/error.hpp"

namespace troupe::detail {

void runtime::own(caf::actor a) {
  std::lock_guard<std::mutex> guard{mtx_};
  if (!open_) {
    caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    throw runner_closed("runner.actor() after close()");
  }
  owned_.push_back(std::move(a));
}

caf::actor_system& runtime_handle::system() const {
  return checked().system();
}

runtime_handle::submitter runtime_handle::guarded_submitter() const {
  return [gate = checked().gate()](std::shared_ptr<input_source> source, consumer_maker make,
                                   bool ordered, job_options o, bool fold) {
    std::lock_guard<std::mutex> guard{gate->mtx};
    if (!gate->rt) throw runner_closed("the runner was closed");
    auto& rt = *gate->rt;
    return rt.submit(
        std::move(source),
        [&make, &rt](caf::actor_system& sys, const std::shared_ptr<job_gate>& g) {
          return spawn_consumer_actor(sys, std::move(make), rt.job_config(), g);
        },
        ordered, std::move(o), fold);
  };
}

void runtime_handle::own(caf::actor a) {
  checked().own(std::move(a));
}

}  // namespace troupe::detail
