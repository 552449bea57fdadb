// A live cluster's membership as a pure part (no CAF, no threads, no clock of its own): the
// cluster's shell (cluster.cpp) feeds it what it saw (a node's answer with its incarnation, the
// time, cluster::add / remove) and acts on the events it returns. Unit and property tests drive
// it directly (tests/membership_test.cpp, tests/membership_properties_test.cpp).
//
// The rules:
// - A member is an address with the incarnation that answered; every node process has its own
//   (random, new at every start).
// - A member that is up or draining and has not answered for lost_after is lost: its
//   incarnation is fenced. An answer of a fenced incarnation is never used (counted, dropped):
//   neither a probe's nor a connect's, and no runner uses that process again.
// - An answer from a new incarnation at a lost member's address: the member rejoined (its
//   restart). At a member that is up with another incarnation (it restarted faster than
//   lost_after): the old incarnation is lost (fenced), then the new one rejoined.
// - remove: up -> draining; the shell's runners drain; end_drain: draining -> drained (never
//   reported as lost). add of a drained (or unknown) address: joined.
// - A node that drains itself (node::drain, SIGTERM) answers `leaving`: up -> draining (its
//   coordinators drain its producers on the node's word, not the cluster's); once it is silent
//   it is drained, not lost, and a new incarnation at its address rejoins (a rolling restart).
// - A member drained by remove() never comes back by itself (not even when it was lost while it
//   drained, or drains itself meanwhile): only add() makes it a member again.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "troupe/node.hpp"

namespace troupe::detail {

/// How often a live cluster's watcher probes each of `members` members: every
/// `o.heartbeat`, or, where that would be more than `o.probes_per_second` probes a second in
/// all, every members / probes_per_second (rounded up to a millisecond).
inline std::chrono::milliseconds probe_period(const cluster_options& o, std::size_t members) {
  if (o.probes_per_second == 0) return o.heartbeat;
  auto ms = (members * 1000 + o.probes_per_second - 1) / o.probes_per_second;
  return std::max(o.heartbeat, std::chrono::milliseconds{static_cast<std::int64_t>(ms)});
}

/// lost_after for a watcher that probes every `period` instead of every heartbeat: in the same
/// proportion (the same number of probes missed).
inline std::chrono::milliseconds scaled_lost_after(const cluster_options& o,
                                                   std::chrono::milliseconds period) {
  if (period <= o.heartbeat) return o.lost_after;
  // At most a year: a day's lost_after over a 1 ms heartbeat, probed every few minutes, would
  // not fit the clock's nanoseconds (and every member was lost at once).
  constexpr double year_ms = 365.0 * 24 * 3600 * 1000;
  auto ms = static_cast<double>(o.lost_after.count()) * static_cast<double>(period.count()) /
            static_cast<double>(o.heartbeat.count());
  return std::chrono::milliseconds{static_cast<std::int64_t>(std::min(ms, year_ms))};
}

class membership {
 public:
  using time_point = std::chrono::steady_clock::time_point;

  explicit membership(std::chrono::milliseconds lost_after) : lost_after_(lost_after) {}
  /// Members are probed less often (many of them: cluster_options::probes_per_second): they
  /// are lost after this long instead.
  void set_lost_after(std::chrono::milliseconds d) { lost_after_ = d; }
  [[nodiscard]] std::chrono::milliseconds lost_after() const { return lost_after_; }

  /// The node at `address` answered (a connect, a reconnect or a probe) as `incarnation`,
  /// offering `devices` ("HOST:PORT/device"). `joining`: cluster::connect / add (a drained or
  /// unknown address becomes a member); otherwise only known members are updated.
  std::vector<membership_event> answered(const std::string& address, std::uint64_t incarnation,
                                         const std::vector<device>& devices, time_point now,
                                         bool joining, bool leaving = false);
  /// `address` is a member not yet up (lost, incarnation 0): retried like a lost one until it
  /// answers (then `joined`). A member drained by remove() or retired is retried again; nothing
  /// changes for any other member.
  void expect(const std::string& address, time_point now);
  /// A member that is not up or draining (lost, never up) is no longer retried: drained as by
  /// remove(), so that only add() (or discovery listing it again) makes it a member. Returns
  /// whether it was such a member.
  bool retire(const std::string& address);
  /// Members that have been silent for lost_after are lost (their incarnations fenced).
  std::vector<membership_event> tick(time_point now);
  /// The member at `address`'s process is gone (its node actor went down: it ended, or its
  /// connection was closed): lost now, as by tick(), or drained when it said it would leave.
  /// nullopt when it was not up or draining.
  std::optional<membership_event> gone(const std::string& address);
  /// cluster::remove began: the member must be up (invalid_argument otherwise).
  membership_event begin_drain(const std::string& address);
  /// The runners have drained it: draining -> drained (nullopt when it was lost meanwhile).
  std::optional<membership_event> end_drain(const std::string& address);
  /// A drain that could not begin after all (a runner refused): draining -> up, no event.
  void cancel_drain(const std::string& address);

  /// Whether answers of `incarnation` at `address` may be used (its member is up or draining
  /// with that incarnation).
  [[nodiscard]] bool accepts(const std::string& address, std::uint64_t incarnation) const;
  /// The member up or draining under another address with this incarnation (the same node
  /// process, its address spelled another way), if any.
  [[nodiscard]] std::optional<std::string> spelled_otherwise(const std::string& address,
                                                             std::uint64_t incarnation) const;
  [[nodiscard]] bool fenced(const std::string& address, std::uint64_t incarnation) const;
  /// The state of the member at `address` (nullopt: never a member).
  [[nodiscard]] std::optional<member::state> state_of(const std::string& address) const;
  /// Whether the member at `address` was drained (or is draining) by cluster::remove.
  [[nodiscard]] bool removed(const std::string& address) const {
    return removed_.count(address) != 0;
  }
  /// Whether the member at `address` drains (or drained) on its own word (node::drain).
  [[nodiscard]] bool leaves_by_itself(const std::string& address) const {
    return self_drained_.count(address) != 0;
  }
  /// Addresses of lost members and of those that drained themselves (to be retried).
  [[nodiscard]] std::vector<std::string> lost() const;
  /// Addresses of members that are up and have not answered for `quiet` (a restart is likely).
  [[nodiscard]] std::vector<std::string> silent(time_point now,
                                                std::chrono::milliseconds quiet) const;
  /// Addresses of members that are up or draining (to be probed).
  [[nodiscard]] std::vector<std::string> watched() const;
  [[nodiscard]] std::vector<member> members() const { return members_; }
  [[nodiscard]] std::size_t fenced_answers() const noexcept { return fenced_answers_; }

 private:
  member* find(const std::string& address);
  [[nodiscard]] const member* find(const std::string& address) const;
  membership_event lose(member& m);
  /// An up or draining member is gone: drained when it drains on its own word, else lost.
  membership_event leave(member& m);
  /// The member is up again as `incarnation` (a join or a rejoin), seen now.
  static void up_again(member& m, time_point& seen, std::uint64_t incarnation,
                       const std::vector<device>& devices, time_point now);
  static membership_event event(membership_event::kind k, const member& m);

  std::chrono::milliseconds lost_after_;
  std::vector<member> members_;                             ///< in the order they first joined
  std::unordered_map<std::string, std::size_t> at_;         ///< a member's place in members_
  std::vector<time_point> last_seen_;                       ///< by member
  std::set<std::pair<std::string, std::uint64_t>> fenced_;  ///< incarnations given up on
  std::size_t fenced_answers_ = 0;
  std::set<std::string> self_drained_;  ///< draining or drained on their own word
  std::set<std::string> removed_;       ///< drained by cluster::remove: only add() brings back
};

}  // namespace troupe::detail
