// The scheduler (scheduler.hpp): its index of the producers with room (room_), kept current by
// room_changed() and read in order by pump(), so that an event costs what the producers it
// changed do, not a sort of every producer; and whether a late chunk may be split or copied.
#include "scheduler.hpp"

namespace troupe::detail {

void scheduler::update_room() {
  if (in_pass_) return;  // a pass reads room_: the changes wait for the next one
  room_key_.resize(producers_.size());
  room_at_.resize(producers_.size(), room_.end());
  for (auto p : room_dirty_) {
    std::optional<std::pair<double, std::size_t>> key;
    if (has_room(producers_[p])) key = producers_[p].load();
    auto& old = room_key_[p];
    if (old == key) continue;
    // By its iterator: an erase by key searched the tree (13 levels at 8,000 producers) twice
    // per answer.
    if (old) room_.erase(room_at_[p]);
    if (key) room_at_[p] = room_.emplace(key->first, key->second, p).first;
    old = key;
  }
  room_dirty_.clear();
  if (fault_points::check_indexes.load(std::memory_order_relaxed)) check_room();
}

void scheduler::check_room() const {
  // Without allocating (the property tests run it at every pass, also under sanitizers).
  std::size_t with_room = 0;
  bool same = room_key_.size() == producers_.size();
  for (std::size_t p = 0; same && p < producers_.size(); ++p) {
    std::optional<std::pair<double, std::size_t>> want;
    if (has_room(producers_[p])) {
      want = producers_[p].load();
      with_room += 1;
      same = room_.count({want->first, want->second, p}) == 1;
    }
    same = same && room_key_[p] == want;
    // A slot's key in room_ is where room_at_ says (room_at_[p] is set with room_key_[p]).
    if (same && want)
      same = p < room_at_.size() && *room_at_[p] == room_key{want->first, want->second, p};
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
