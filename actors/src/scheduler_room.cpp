// The scheduler (scheduler.hpp): its index of the producers with room (room_), kept current by
// room_changed() and read in order by pump(), so that an event costs what the producers it
// changed do, not a sort of every producer; and whether a late chunk may be split or copied.
#include "scheduler.hpp"

namespace troupe::detail {

void scheduler::update_room() {
  if (in_pass_) return;  // a pass reads room_: the changes wait for the next one
  room_at_.resize(producers_.size());
  for (auto p : room_dirty_) {
    std::optional<room_key> key;
    if (has_room(producers_[p])) key = std::tuple_cat(producers_[p].load(), std::make_tuple(p));
    auto& at = room_at_[p];
    if (at ? key && **at == *key : !key) continue;
    // By its iterator: an erase by key searched the tree (13 levels at 8,000 producers) twice
    // per answer.
    if (at) room_.erase(*at);
    at.reset();
    if (key) at = room_.insert(*key).first;
  }
  room_dirty_.clear();
  if (fault_points::check_indexes.load(std::memory_order_relaxed)) check_room();
}

void scheduler::check_room() const {
  // Without allocating (the property tests run it at every pass, also under sanitizers).
  std::size_t with_room = 0;
  bool same = room_at_.size() == producers_.size();
  for (std::size_t p = 0; same && p < producers_.size(); ++p) {
    std::optional<room_key> want;
    if (has_room(producers_[p])) {
      want = std::tuple_cat(producers_[p].load(), std::make_tuple(p));
      with_room += 1;
      same = room_.count(*want) == 1;
    }
    // Its key in room_ is where room_at_ says.
    auto& at = room_at_[p];
    same = same && (want ? at && **at == *want : !at);
  }
  if (!same || with_room != room_.size())
    throw std::logic_error("scheduler: the index of producers with room (" +
                           std::to_string(room_.size()) + ") differs from a scan (" +
                           std::to_string(with_room) + "): a change missed room_changed()");
}

bool scheduler::late_chunks_possible(clock_type::time_point now) const {
  auto before = [&](const std::optional<clock_type::time_point>& t) { return t && now < *t; };
  return (opts_.speculative && !before(nothing_late_before_)) ||
         (any_cuts_ && !before(no_split_before_));
}

}  // namespace troupe::detail
