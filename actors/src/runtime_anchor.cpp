// The anchor of a runner's producers on nodes (runtime_impl.hpp): their owner, which passes a
// draining node's notice on to the scheduler.
#include <algorithm>
#include <caf/event_based_actor.hpp>
#include <memory>
#include <vector>

#include "runtime_impl.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

/// The owner of a runner's producers on nodes: they live as long as it does (the nodes monitor
/// it). A draining node tells it which of them are leaving; it passes that to the scheduler,
/// or keeps it until the scheduler exists (a node that drains while the runner starts: its
/// producers' init is under way, the scheduler comes after it).
caf::behavior anchor_actor(caf::event_based_actor* self, int) {
  struct state {
    caf::actor scheduler;
    std::vector<caf::actor> early;  ///< leaving before the scheduler existed (at most max_early)
  };
  static constexpr std::size_t max_early = 65536;
  auto st = std::make_shared<state>();
  return {
      [](int) {},
      [self, st](caf::actor& s) {
        st->scheduler = std::move(s);
        if (!st->early.empty())
          self->send(st->scheduler, leaving_atom::value, std::move(st->early));
        st->early.clear();
      },
      [self, st](leaving_atom, std::vector<caf::actor>& producers) {
        // Only a node's own producers: a peer cannot drain another node's.
        auto sender = self->current_sender();
        if (sender == nullptr) return;
        producers.erase(
            std::remove_if(producers.begin(), producers.end(),
                           [&](const caf::actor& p) { return !p || p.node() != sender->node(); }),
            producers.end());
        if (producers.empty()) return;
        if (st->scheduler) {
          self->send(st->scheduler, leaving_atom::value, std::move(producers));
          return;
        }
        for (auto& p : producers)
          if (st->early.size() < max_early) st->early.push_back(std::move(p));
      },
  };
}

}  // namespace troupe::detail
