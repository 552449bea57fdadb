// troupe's exceptions (thrown at the API edge) and error codes (carried in messages).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace troupe {

/// Error codes carried inside messages (as caf::error with category "troupe").
enum class errc : std::uint8_t {
  none = 0,
  invalid_argument,
  device_unavailable,
  init_error,
  work_error,
  consumer_error,
  runner_closed,
  config_error,
  node_error,
  protocol_error,
  cancelled,
  deadline_exceeded,
};

/// Returns a short name for `code`, e.g. "work_error".
const char* to_string(errc code) noexcept;

/// Base of every exception troupe throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
  [[nodiscard]] virtual errc code() const noexcept = 0;
};

#define TROUPE_DECLARE_ERROR(name)                                           \
  class name : public error {                                                \
   public:                                                                   \
    using error::error;                                                      \
    [[nodiscard]] errc code() const noexcept override { return errc::name; } \
  };

TROUPE_DECLARE_ERROR(invalid_argument)
TROUPE_DECLARE_ERROR(device_unavailable)
TROUPE_DECLARE_ERROR(init_error)
TROUPE_DECLARE_ERROR(consumer_error)
TROUPE_DECLARE_ERROR(runner_closed)
TROUPE_DECLARE_ERROR(config_error)
TROUPE_DECLARE_ERROR(node_error)
TROUPE_DECLARE_ERROR(protocol_error)
/// job_handle::cancel() (or leaving a stream early) ended the job.
TROUPE_DECLARE_ERROR(cancelled)
/// The job's job_options::deadline passed before it finished.
TROUPE_DECLARE_ERROR(deadline_exceeded)

#undef TROUPE_DECLARE_ERROR

/// `producer::work` threw. `index()` is the item's 0-based position in the run's input,
/// `where()` the device that ran it.
class work_error : public error {
 public:
  work_error(const std::string& what, std::uint64_t index, std::string where)
      : error(what), index_(index), where_(std::move(where)) {}
  [[nodiscard]] errc code() const noexcept override { return errc::work_error; }
  [[nodiscard]] std::uint64_t index() const noexcept { return index_; }
  [[nodiscard]] const std::string& where() const noexcept { return where_; }

 private:
  std::uint64_t index_;
  std::string where_;
};

/// Throws the exception type that matches `code`, with message `what`.
/// `work_error` needs an index and a device: use its constructor instead.
[[noreturn]] void throw_error(errc code, const std::string& what);

}  // namespace troupe
