// troupe's exceptions (thrown at the API edge) and error codes (carried in messages).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace troupe {

/// Every error code but `none`, in wire order (the value of each is its place here, from 1):
/// X(name, simple). `simple`: 1 when the exception of that name takes only a message (declared
/// below by this list), 0 for work_error (declared by hand). The enum, the exception classes,
/// to_string() and throw_error() are all made from this one list.
#define TROUPE_ERROR_CODES(X) \
  X(invalid_argument, 1)      \
  X(device_unavailable, 1)    \
  X(init_error, 1)            \
  X(work_error, 0)            \
  X(consumer_error, 1)        \
  X(runner_closed, 1)         \
  X(config_error, 1)          \
  X(node_error, 1)            \
  X(protocol_error, 1)        \
  X(cancelled, 1)             \
  X(deadline_exceeded, 1)     \
  X(overloaded, 1)

/// Error codes carried inside messages (as caf::error with category "troupe").
enum class errc : std::uint8_t {
  none = 0,
#define TROUPE_DETAIL_ERRC(name, simple) name,
  TROUPE_ERROR_CODES(TROUPE_DETAIL_ERRC)
#undef TROUPE_DETAIL_ERRC
};

/// Returns a short name for `code`, e.g. "work_error".
const char* to_string(errc code) noexcept;

/// Base of every exception troupe throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
  [[nodiscard]] virtual errc code() const noexcept = 0;
};

// One exception class per simple code, named like it: invalid_argument, device_unavailable,
// init_error, consumer_error, runner_closed, config_error, node_error, protocol_error,
// cancelled (job_handle::cancel() or leaving a stream early ended the job),
// deadline_exceeded (the job's job_options::deadline passed before it finished) and overloaded
// (submit() found options::max_queued_items items waiting already: the job was not started).
#define TROUPE_DETAIL_DECLARE_ERROR_1(name)                                  \
  class name : public error {                                                \
   public:                                                                   \
    using error::error;                                                      \
    [[nodiscard]] errc code() const noexcept override { return errc::name; } \
  };
#define TROUPE_DETAIL_DECLARE_ERROR_0(name)
#define TROUPE_DETAIL_DECLARE_ERROR(name, simple) TROUPE_DETAIL_DECLARE_ERROR_##simple(name)
TROUPE_ERROR_CODES(TROUPE_DETAIL_DECLARE_ERROR)
#undef TROUPE_DETAIL_DECLARE_ERROR
#undef TROUPE_DETAIL_DECLARE_ERROR_0
#undef TROUPE_DETAIL_DECLARE_ERROR_1

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
