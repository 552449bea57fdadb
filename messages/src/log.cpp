#include "troupe/log.hpp"

#include <atomic>
#include <mutex>

#include <spdlog/sinks/null_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

namespace troupe {
namespace {

std::shared_ptr<spdlog::logger> make_silent() {
  return std::make_shared<spdlog::logger>("troupe", std::make_shared<spdlog::sinks::null_sink_mt>());
}

std::mutex logger_mutex;
std::shared_ptr<spdlog::logger>& current() {
  static std::shared_ptr<spdlog::logger> instance = make_silent();
  return instance;
}

}  // namespace

spdlog::logger& log() {
  std::lock_guard<std::mutex> guard{logger_mutex};
  // Loggers installed by the user are kept alive for the whole process, so that a reference
  // handed out here never dangles when the logger is replaced.
  static std::vector<std::shared_ptr<spdlog::logger>> keep_alive;
  auto& ptr = current();
  if (keep_alive.empty() || keep_alive.back() != ptr) keep_alive.push_back(ptr);
  return *ptr;
}

void set_logger(std::shared_ptr<spdlog::logger> logger) {
  std::lock_guard<std::mutex> guard{logger_mutex};
  current() = logger ? std::move(logger) : make_silent();
}

void log_to_stderr(spdlog::level::level_enum level) {
  auto logger = std::make_shared<spdlog::logger>(
      "troupe", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  logger->set_level(level);
  set_logger(std::move(logger));
}

}  // namespace troupe
