// troupe's one logger. The library is silent by default: it logs to a null sink until the
// embedding application installs a logger (any spdlog logger) or calls log_to_stderr().
#pragma once

#include <memory>

#include <spdlog/logger.h>

namespace troupe {

/// The logger every part of troupe writes its diagnostics to.
spdlog::logger& log();

/// Replaces troupe's logger (thread-safe). Passing nullptr silences troupe again.
void set_logger(std::shared_ptr<spdlog::logger> logger);

/// Convenience: log `level` and above to standard error.
void log_to_stderr(spdlog::level::level_enum level = spdlog::level::info);

}  // namespace troupe
