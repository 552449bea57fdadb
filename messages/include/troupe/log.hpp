// troupe's one logger. The library is silent by default: diagnostics go to a handler that the
// embedding application installs (set_log_handler), or to stderr after log_to_stderr().
// (Not spdlog: the LibTorch wheel bundles its own fmt, which clashes with Debian's spdlog.)
#pragma once

#include <functional>
#include <string>

namespace troupe {

enum class log_level { debug = 0, info, warn, error, off };

const char* to_string(log_level level) noexcept;

using log_handler = std::function<void(log_level, const std::string&)>;

/// Replaces the handler (thread-safe). nullptr silences troupe again.
void set_log_handler(log_handler handler);

/// Convenience: log `min` and above to standard error, one line per message.
void log_to_stderr(log_level min = log_level::info);

/// Sends one diagnostic line to the installed handler, if any.
void log(log_level level, const std::string& message);

}  // namespace troupe
