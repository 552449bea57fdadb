#include "troupe/detail/job_actors.hpp"

namespace troupe::detail {

std::string describe_current_exception() {
  try {
    throw;
  } catch (const std::exception& e) {
    std::string what = e.what();
    // LibTorch appends a backtrace ("Exception raised from ..."): keep the first part.
    if (auto cut = what.find("\nException raised from"); cut != std::string::npos) what.resize(cut);
    return what;
  } catch (...) {
    return "an exception of a type not derived from std::exception";
  }
}

}  // namespace troupe::detail
