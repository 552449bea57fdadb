// Numbers an owner publishes for observers (troupe::metrics_text, the status page): the owner
// writes its view under the entry's lock, observers copy every live entry's view. No CAF here.
#pragma once

#include <algorithm>
#include <memory>
#include <mutex>
#include <vector>

namespace troupe::detail {

template <class View>
struct published {
  std::mutex mtx;
  View view;
};

/// The entries alive in this process, oldest first.
template <class View>
class published_list {
 public:
  void add(std::shared_ptr<published<View>> p) {
    std::lock_guard<std::mutex> guard{mtx_};
    live_.push_back(std::move(p));
  }
  void remove(const published<View>* p) noexcept {
    std::lock_guard<std::mutex> guard{mtx_};
    live_.erase(
        std::remove_if(live_.begin(), live_.end(),
                       [p](const std::shared_ptr<published<View>>& x) { return x.get() == p; }),
        live_.end());
  }
  [[nodiscard]] std::vector<View> views() {
    std::vector<std::shared_ptr<published<View>>> live;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      live = live_;
    }
    std::vector<View> out;
    for (auto& p : live) {
      std::lock_guard<std::mutex> guard{p->mtx};
      out.push_back(p->view);
    }
    return out;
  }

 private:
  std::mutex mtx_;
  std::vector<std::shared_ptr<published<View>>> live_;
};

}  // namespace troupe::detail
