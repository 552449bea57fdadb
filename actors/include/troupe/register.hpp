// TROUPE_REGISTER_JOB(job): makes a job runnable by name on nodes of this program, and lets
// runners of this program use remote devices for it. Write it at namespace scope, in the
// coordinator's program and in every node's program. The job's input and output types must be
// serializable by CAF (an inspect() overload; include <troupe/torch.hpp> for tensors).
#pragma once

#include <caf/detail/type_traits.hpp>
#include <string>
#include <type_traits>
#include <typeinfo>

#include "troupe/batch.hpp"
#include "troupe/detail/job_ops.hpp"

namespace troupe {

namespace detail {
/// Registers a job's producer objects under `name` (the library wraps them in producer actors
/// for nodes); returns true.
bool register_job_ops(const std::string& name, const std::type_info& job, producer_maker make,
                      std::string signature);
}  // namespace detail

/// How a training job (one with a nested `replica`) registers: defined in <troupe/train.hpp>,
/// which must be included before TROUPE_REGISTER_JOB names such a job.
template <class Job, class = void>
struct train_registrar;

namespace detail {
template <class T, class = void>
struct has_replica : std::false_type {};
template <class T>
struct has_replica<T, std::void_t<typename T::replica>> : std::true_type {};

template <class Job>
bool register_producer_job(const char* name) {
  using traits = detail::job_traits<Job>;
  static_assert(detail::wire_serializable<typename traits::input_type> &&
                    detail::wire_serializable<typename traits::output_type>,
                "troupe: TROUPE_REGISTER_JOB needs input and output types that can cross the "
                "network: give them an inspect() overload (include <troupe/torch.hpp> for "
                "tensors), or make them structs of plain data (trivially copyable, no padding)");
  using in = typename traits::input_type;
  using out = typename traits::output_type;
  register_batch_type<in>();
  register_batch_type<out>();
  return detail::register_job_ops(
      name, typeid(Job), &detail::make_producer_ops<Job>,
      batch_type_name(typeid(in)) + " -> " + batch_type_name(typeid(out)));
}
}  // namespace detail

template <class Job>
bool register_job_type(const char* name) {
  if constexpr (detail::has_replica<Job>::value && !detail::has_producer<Job>::value)
    return train_registrar<Job>::reg(name);
  else
    return detail::register_producer_job<Job>(name);
}

}  // namespace troupe

#define TROUPE_DETAIL_CONCAT2(a, b) a##b
#define TROUPE_DETAIL_CONCAT(a, b) TROUPE_DETAIL_CONCAT2(a, b)
#define TROUPE_REGISTER_JOB(job)                                                                 \
  [[maybe_unused]] static const bool TROUPE_DETAIL_CONCAT(troupe_job_registered_, __COUNTER__) = \
      ::troupe::register_job_type<job>(#job)
