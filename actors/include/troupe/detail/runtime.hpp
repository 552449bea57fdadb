// What a runner template needs of its compiled core (actors/src/runtime_impl.hpp): create it,
// hand it jobs, close it. No CAF actor headers here: they stay in the library.
#pragma once

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

class runtime;
struct runtime_deleter {
  void operator()(runtime* rt) const noexcept;
};
using runtime_ptr = std::unique_ptr<runtime, runtime_deleter>;

/// Starts one producer per device (objects made by `make`) and waits until each has been
/// constructed. Throws invalid_argument, device_unavailable or init_error. `job`: the job's
/// registered name ("" if none), needed for remote devices.
runtime_ptr make_runtime(std::vector<device> devices, config cfg, options opts, std::string job,
                         producer_maker make);
/// Starts a job: `source` through the producers into a fresh consumer made by `make`, next to
/// the jobs already running. Throws runner_closed after close(), invalid_argument for bad
/// options.
std::shared_ptr<job_core> submit_job(runtime& rt, std::shared_ptr<input_source> source,
                                     consumer_maker make, bool ordered, job_options o);
/// The same with a stream's bounded buffer in place of a consumer.
std::shared_ptr<job_core> submit_stream(runtime& rt, std::shared_ptr<input_source> source,
                                        std::shared_ptr<stream_buffer> buf, bool ordered,
                                        job_options o);
void close_runtime(runtime& rt) noexcept;
[[nodiscard]] bool runtime_open(const runtime& rt);
[[nodiscard]] const std::vector<device>& runtime_devices(const runtime& rt) noexcept;
[[nodiscard]] troupe::stats runtime_stats(const runtime& rt);

}  // namespace troupe::detail
