#include "troupe/internal/membership.hpp"

#include <algorithm>

#include "troupe/error.hpp"

namespace troupe {

const char* to_string(membership_event::kind k) noexcept {
  switch (k) {
    case membership_event::joined:
      return "joined";
    case membership_event::draining:
      return "draining";
    case membership_event::drained:
      return "drained";
    case membership_event::lost:
      return "lost";
    case membership_event::rejoined:
      return "rejoined";
  }
  return "?";
}

const char* to_string(member::state s) noexcept {
  switch (s) {
    case member::state::up:
      return "up";
    case member::state::draining:
      return "draining";
    case member::state::drained:
      return "drained";
    case member::state::lost:
      return "lost";
  }
  return "?";
}

namespace detail {

member* membership::find(const std::string& address) {
  auto i = at_.find(address);
  return i == at_.end() ? nullptr : &members_[i->second];
}

const member* membership::find(const std::string& address) const {
  auto i = at_.find(address);
  return i == at_.end() ? nullptr : &members_[i->second];
}

membership_event membership::event(membership_event::kind k, const member& m) {
  return membership_event{k, m.address, m.incarnation, m.devices};
}

membership_event membership::lose(member& m) {
  fenced_.insert({m.address, m.incarnation});
  m.what = member::state::lost;
  return event(membership_event::lost, m);
}

void membership::up_again(member& m, time_point& seen, std::uint64_t incarnation,
                          const std::vector<device>& devices, time_point now) {
  m.incarnation = incarnation;
  m.devices = devices;
  m.what = member::state::up;
  seen = now;
}

std::vector<membership_event> membership::answered(const std::string& address,
                                                   std::uint64_t incarnation,
                                                   const std::vector<device>& devices,
                                                   time_point now, bool joining, bool leaving) {
  std::vector<membership_event> out;
  if (fenced(address, incarnation)) {  // a process given up on: never used again
    fenced_answers_ += 1;
    return out;
  }
  auto* m = find(address);
  if (m == nullptr) {
    if (!joining || leaving) return out;
    at_.emplace(address, members_.size());
    members_.push_back(member{address, incarnation, member::state::up, devices});
    last_seen_.push_back(now);
    out.push_back(event(membership_event::joined, members_.back()));
    return out;
  }
  auto& seen = last_seen_[static_cast<std::size_t>(m - members_.data())];
  switch (m->what) {
    case member::state::drained:
      if (leaving) return out;  // not back yet
      if (!joining) {
        if (removed_.count(address) != 0) return out;
        // Drained on its own word (a rolling restart): its next process rejoins. Removed by
        // cluster::remove: only add() makes it a member again.
        if (self_drained_.count(address) == 0 || incarnation == m->incarnation) return out;
        self_drained_.erase(address);
        up_again(*m, seen, incarnation, devices, now);
        out.push_back(event(membership_event::rejoined, *m));
        return out;
      }
      self_drained_.erase(address);
      removed_.erase(address);
      up_again(*m, seen, incarnation, devices, now);
      out.push_back(event(membership_event::joined, *m));
      return out;
    case member::state::lost: {
      if (leaving) return out;
      bool was_removed = removed_.count(address) != 0;
      if (was_removed) {           // lost while cluster::remove drained it:
        if (!joining) return out;  // only add() makes it a member again
        removed_.erase(address);
      }
      bool never_up = m->incarnation == 0;  // expect(): its first answer is a join
      up_again(*m, seen, incarnation, devices, now);
      out.push_back(event(
          was_removed || never_up ? membership_event::joined : membership_event::rejoined, *m));
      return out;
    }
    case member::state::up:
    case member::state::draining:
      if (m->incarnation == incarnation) {
        seen = now;
        if (leaving && m->what == member::state::up) {
          m->what = member::state::draining;
          self_drained_.insert(address);
          out.push_back(event(membership_event::draining, *m));
        } else if (leaving) {
          self_drained_.insert(address);  // removed, and now leaving too: silent is drained
        }
        return out;
      }
      if (leaving) return out;  // a new process that already leaves: not a member
      // Restarted faster than lost_after. A process that drained itself left (drained); any
      // other is given up on (lost, fenced). A member that cluster::remove drains stays out.
      if (m->what == member::state::draining && self_drained_.count(address) != 0) {
        fenced_.insert({m->address, m->incarnation});  // gone: nothing of it is used again
        m->what = member::state::drained;
        out.push_back(event(membership_event::drained, *m));
        self_drained_.erase(address);
        if (removed_.count(address) != 0) return out;  // only add() brings it back
      } else {
        bool was_draining = m->what == member::state::draining;
        out.push_back(lose(*m));
        if (was_draining) return out;
      }
      up_again(*m, seen, incarnation, devices, now);
      out.push_back(event(membership_event::rejoined, *m));
      return out;
  }
  return out;
}

void membership::expect(const std::string& address, time_point now) {
  if (auto* m = find(address)) {
    if (m->what == member::state::drained && removed_.count(address) != 0) {
      m->what = member::state::lost;  // retired (or removed) earlier, wanted again: retried
      removed_.erase(address);
    }
    return;
  }
  at_.emplace(address, members_.size());
  members_.push_back(member{address, 0, member::state::lost, {}});
  last_seen_.push_back(now);
}

bool membership::retire(const std::string& address) {
  auto* m = find(address);
  if (m == nullptr || m->what == member::state::up || m->what == member::state::draining)
    return false;
  if (m->what == member::state::lost) m->what = member::state::drained;
  removed_.insert(address);
  self_drained_.erase(address);
  return true;
}

std::vector<membership_event> membership::tick(time_point now) {
  std::vector<membership_event> out;
  for (std::size_t i = 0; i < members_.size(); ++i) {
    auto& m = members_[i];
    if (m.what != member::state::up && m.what != member::state::draining) continue;
    if (now - last_seen_[i] <= lost_after_) continue;
    out.push_back(leave(m));
  }
  return out;
}

std::optional<membership_event> membership::gone(const std::string& address) {
  auto* m = find(address);
  if (m == nullptr || (m->what != member::state::up && m->what != member::state::draining))
    return std::nullopt;
  return leave(*m);
}

membership_event membership::leave(member& m) {
  if (m.what == member::state::draining && self_drained_.count(m.address) != 0) {
    fenced_.insert({m.address, m.incarnation});  // gone: nothing of it is used again
    m.what = member::state::drained;             // it left as it said it would: not a loss
    return event(membership_event::drained, m);
  }
  return lose(m);
}

membership_event membership::begin_drain(const std::string& address) {
  auto* m = find(address);
  if (m == nullptr) throw invalid_argument("cluster::remove: " + address + " is not a member");
  if (m->what != member::state::up)
    throw invalid_argument("cluster::remove: " + address + " is " + to_string(m->what) +
                           ", not up");
  m->what = member::state::draining;
  removed_.insert(address);
  return event(membership_event::draining, *m);
}

std::optional<membership_event> membership::end_drain(const std::string& address) {
  auto* m = find(address);
  if (m == nullptr || m->what != member::state::draining) return std::nullopt;
  m->what = member::state::drained;
  return event(membership_event::drained, *m);
}

void membership::cancel_drain(const std::string& address) {
  auto* m = find(address);
  if (m != nullptr && m->what == member::state::draining) {
    m->what = member::state::up;
    removed_.erase(address);
  }
}

std::optional<std::string> membership::spelled_otherwise(const std::string& address,
                                                         std::uint64_t incarnation) const {
  for (auto& m : members_)
    if (m.address != address && m.incarnation == incarnation &&
        (m.what == member::state::up || m.what == member::state::draining))
      return m.address;
  return std::nullopt;
}

bool membership::accepts(const std::string& address, std::uint64_t incarnation) const {
  auto* m = find(address);
  return m != nullptr && m->incarnation == incarnation &&
         (m->what == member::state::up || m->what == member::state::draining);
}

bool membership::fenced(const std::string& address, std::uint64_t incarnation) const {
  return fenced_.count({address, incarnation}) != 0;
}

std::optional<member::state> membership::state_of(const std::string& address) const {
  auto* m = find(address);
  if (m == nullptr) return std::nullopt;
  return m->what;
}

std::vector<std::string> membership::lost() const {
  std::vector<std::string> out;
  for (auto& m : members_)
    if (removed_.count(m.address) == 0 &&
        (m.what == member::state::lost ||
         (m.what == member::state::drained && self_drained_.count(m.address) != 0)))
      out.push_back(m.address);
  return out;
}

std::vector<std::string> membership::silent(time_point now, std::chrono::milliseconds quiet) const {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < members_.size(); ++i)
    if ((members_[i].what == member::state::up ||
         (members_[i].what == member::state::draining &&
          self_drained_.count(members_[i].address) != 0)) &&
        now - last_seen_[i] > quiet)
      out.push_back(members_[i].address);
  return out;
}

std::vector<std::string> membership::watched() const {
  std::vector<std::string> out;
  for (auto& m : members_)
    if (m.what == member::state::up || m.what == member::state::draining) out.push_back(m.address);
  return out;
}

}  // namespace detail
}  // namespace troupe
