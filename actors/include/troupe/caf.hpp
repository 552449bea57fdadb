// troupe inside a CAF application (docs/api.md, "Embedding in applications"): troupe's types in
// the application's actor_system_config, runners on the application's actor system, and a
// runner as a CAF actor that answers requests with the job's result.
#pragma once

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/result.hpp>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "troupe/error.hpp"
#include "troupe/outcome.hpp"
#include "troupe/protocol.hpp"
#include "troupe/runner.hpp"

// A completion handed to runner.actor()'s actor, to run on its own thread.
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<std::function<void()>>)

namespace troupe {

/// Registers troupe's message types in an application's config and loads CAF's middleman (for
/// runners over nodes' devices). Call before constructing the actor_system.
void add_to(caf::actor_system_config& cfg);

/// runner.actor() answers (submit_atom::value, std::vector<In>) with the job's result.
using submit_atom = caf::atom_constant<caf::atom("tr_submit")>;

namespace detail {

/// A job's exception as a CAF error: troupe's own errors keep their code (error_code(),
/// error_text() read them back), anything else is a work_error with its what().
inline caf::error to_caf_error(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const troupe::error& x) {
    return make_error(x.code(), x.what());
  } catch (const std::exception& x) {
    return make_error(errc::work_error, x.what());
  } catch (...) {
    return make_error(errc::work_error, "the job threw something that is not a std::exception");
  }
}

template <class Job, ordering Order>
struct caf_bridge<basic_runner<Job, Order>> {
  using runner = basic_runner<Job, Order>;
  using in = typename runner::input_type;
  using result = typename runner::result_type;
  using traits = job_traits<Job>;
  using actor_type = caf::actor;

  /// An actor on the runner's system: each request is a job; its answer comes from the job's
  /// completion (then()), so no thread waits and requests are served concurrently. It submits
  /// through a guarded submitter: after the runner has closed, requests get runner_closed.
  static caf::actor make(runtime_handle::submitter submit, caf::actor_system& sys) {
    return sys.spawn(
        [](caf::event_based_actor* self, runtime_handle::submitter go) -> caf::behavior {
          return {
              [self, go](submit_atom, std::vector<in>& xs) -> caf::result<result> {
                auto rp = self->make_response_promise<result>();
                try {
                  auto slot = std::make_shared<std::optional<result>>();
                  auto core = go(make_job_source<in>(std::move(xs)), make_consumer_maker<Job>(slot),
                                 Order == ordering::ordered, {}, traits::folds);
                  // Delivered from this actor's own thread (a message to itself): CAF 0.17's
                  // response_promise is not meant to be used from another thread.
                  auto me = caf::actor_cast<caf::actor>(self);
                  job_handle<result>{std::move(core), std::move(slot)}.then(
                      [me](std::function<void()> deliver) {
                        caf::anon_send(me,
                                       std::make_shared<std::function<void()>>(std::move(deliver)));
                      },
                      [rp](outcome<result> o) mutable {
                        if (o.ok())
                          rp.deliver(std::move(*o.value));
                        else
                          rp.deliver(to_caf_error(o.error));
                      });
                } catch (...) {  // the runner has closed, say
                  rp.deliver(to_caf_error(std::current_exception()));
                }
                return rp;
              },
              [](std::shared_ptr<std::function<void()>>& deliver) { (*deliver)(); },
          };
        },
        std::move(submit));
  }
};

}  // namespace detail
}  // namespace troupe
