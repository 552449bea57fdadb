#include "troupe/log.hpp"

#include <iostream>
#include <memory>
#include <mutex>

namespace troupe {
namespace {

std::mutex handler_mutex;
std::shared_ptr<const log_handler> current_handler;

}  // namespace

const char* to_string(log_level level) noexcept {
  switch (level) {
    case log_level::debug:
      return "debug";
    case log_level::info:
      return "info";
    case log_level::warn:
      return "warn";
    case log_level::error:
      return "error";
    case log_level::off:
      break;
  }
  return "off";
}

void set_log_handler(log_handler handler) {
  auto next = handler ? std::make_shared<const log_handler>(std::move(handler)) : nullptr;
  std::lock_guard<std::mutex> guard{handler_mutex};
  current_handler = std::move(next);
}

void log_to_stderr(log_level min) {
  set_log_handler([min](log_level level, const std::string& message) {
    if (level >= min) std::cerr << "[troupe " << to_string(level) << "] " << message << std::endl;
  });
}

void log(log_level level, const std::string& message) {
  std::shared_ptr<const log_handler> handler;
  {
    std::lock_guard<std::mutex> guard{handler_mutex};
    handler = current_handler;
  }
  if (handler) (*handler)(level, message);
}

}  // namespace troupe
