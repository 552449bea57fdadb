// The life of one producer slot as one state (working, restarting, quarantined, draining, ...)
// and one transition function, not a set of flags. A part of the scheduler's core with no actor in
// it, unit-tested on its own (tests/scheduler_parts_test.cpp: the whole table, and random event
// sequences).
#pragma once

#include <cstdint>

namespace troupe::detail {

/// Where a producer slot is in its life. Slots are never reused: `retired` is final.
enum class slot_state : std::uint8_t {
  working,      ///< takes work
  restarting,   ///< lost; a fresh producer is starting on its device
  lost,         ///< lost, unreachable or stuck, and not being replaced
  quarantined,  ///< its work() threw options::quarantine_after times in a row
  draining,     ///< remove_devices: takes no new work, delivers the chunks it holds
  ending,       ///< drained (or draining at close): producer::end() asked, not yet answered
  closing,      ///< close(): producer::end() asked, not yet answered
  end_lost,     ///< lost while its end() was awaited: still waited for (or its time runs out)
  closed,       ///< close(): producer::end() has answered
  retired,      ///< removed: never takes work again
};

/// What happens to a slot.
enum class slot_event : std::uint8_t {
  lose,            ///< lost, unreachable or stuck (give_up)
  quarantine,      ///< its work() threw too often in a row
  restart,         ///< a fresh producer was asked for (after a loss)
  replaced,        ///< the fresh producer started
  replace_failed,  ///< the fresh producer failed to start, or close() stopped it
  drain,           ///< remove_devices asked
  end,             ///< producer::end() asked (a drained slot's, or close()'s)
  ended,           ///< producer::end() answered
  retire,          ///< done with: no work ever again
};

/// The state after `e` in state `s`. An event that does not apply in `s` leaves it as it is
/// (the scheduler's handlers may see late news: a loss after the slot was retired, a second
/// loss, an end() answer after a retirement); the table is tested whole.
/// Only a working slot drains: the scheduler retires a restarting, lost or quarantined one at
/// once (it holds no chunks, a loss re-queued them, and has no producer to end).
constexpr slot_state next(slot_state s, slot_event e) noexcept {
  using st = slot_state;
  using ev = slot_event;
  if (s == st::retired) return s;
  if (e == ev::retire) return st::retired;
  switch (s) {
    case st::working:
      return e == ev::lose         ? st::lost
             : e == ev::quarantine ? st::quarantined
             : e == ev::drain      ? st::draining
             : e == ev::end        ? st::closing
                                   : s;
    case st::restarting:
      return e == ev::replaced ? st::working : e == ev::replace_failed ? st::lost : s;
    case st::lost:
      return e == ev::restart ? st::restarting : s;
    case st::quarantined:
      return s;
    case st::draining:
      return e == ev::lose || e == ev::quarantine ? st::lost : e == ev::end ? st::ending : s;
    case st::ending:
    case st::closing:
      return e == ev::lose || e == ev::quarantine ? st::end_lost : e == ev::ended ? st::closed : s;
    case st::end_lost:
      return e == ev::ended ? st::lost : s;
    case st::closed:
      return e == ev::lose || e == ev::quarantine ? st::lost : s;
    case st::retired:
      return s;
  }
  return s;
}

/// Its producer runs and answers (it may hold chunks).
constexpr bool alive(slot_state s) noexcept {
  return s == slot_state::working || s == slot_state::draining || s == slot_state::ending ||
         s == slot_state::closing || s == slot_state::closed;
}

/// It may take work now or soon: working or being replaced (not leaving, not closing).
constexpr bool takes_work(slot_state s) noexcept {
  return s == slot_state::working || s == slot_state::restarting;
}

/// It is being removed (remove_devices) and is not gone yet.
constexpr bool leaving(slot_state s) noexcept {
  return s == slot_state::draining || s == slot_state::ending;
}

/// Its producer::end() was asked and has not answered.
constexpr bool end_pending(slot_state s) noexcept {
  return s == slot_state::ending || s == slot_state::closing || s == slot_state::end_lost;
}

constexpr const char* name(slot_state s) noexcept {
  switch (s) {
    case slot_state::working:
      return "working";
    case slot_state::restarting:
      return "restarting";
    case slot_state::lost:
      return "lost";
    case slot_state::quarantined:
      return "quarantined";
    case slot_state::draining:
      return "draining";
    case slot_state::ending:
      return "ending";
    case slot_state::closing:
      return "closing";
    case slot_state::end_lost:
      return "end_lost";
    case slot_state::closed:
      return "closed";
    case slot_state::retired:
      return "retired";
  }
  return "?";
}

}  // namespace troupe::detail
