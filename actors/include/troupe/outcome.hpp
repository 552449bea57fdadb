// troupe::outcome: how a job ended, as a value: its result or the exception get() would throw
// (job_handle::then, troupe::testing::explore).
#pragma once

#include <exception>
#include <optional>
#include <utility>

#include "troupe/error.hpp"

namespace troupe {

template <class R>
struct outcome {
  std::optional<R> value;
  std::exception_ptr error;

  [[nodiscard]] bool ok() const noexcept { return value.has_value(); }
  /// The value (moved out), or the job's exception rethrown.
  R get() {
    if (error) std::rethrow_exception(error);
    if (!value) throw invalid_argument("troupe::outcome::get() on an outcome with no value");
    return std::move(*value);
  }
};

}  // namespace troupe
