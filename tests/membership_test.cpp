// The membership part of a live cluster (nodes/internal/troupe/internal/membership.hpp): unit
// tests, and a property test over thousands of seeded schedules of node processes that start,
// die, freeze, drain themselves, are drained, restart and answer late, with items dispatched to
// the members the way a runner does. TROUPE_MEMBERSHIP_SEEDS=100000 runs the 100,000 of the
// docs; TROUPE_MEMBERSHIP_SEED=<seed> replays one.
#include <gtest/gtest.h>

#include <cstdlib>
#include <deque>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <troupe/internal/membership.hpp>

#include "membership_parts.hpp"

namespace {

std::vector<membership_event::kind> kinds(const std::vector<membership_event>& es) {
  std::vector<membership_event::kind> out;
  for (auto& e : es) out.push_back(e.what);
  return out;
}

const std::string A = "127.0.0.1:1001", B = "127.0.0.1:1002";

}  // namespace

TEST(Membership, AnAnswerOfAGivenUpIncarnationIsNeverUsedAndItsRestartRejoins) {
  membership m{ms{1500}};
  auto t0 = clock_type::now();
  EXPECT_EQ(kinds(m.answered(A, 7, devs(A), t0, true)),
            (std::vector<membership_event::kind>{membership_event::joined}));
  EXPECT_TRUE(m.tick(t0 + ms{1000}).empty());
  auto lost = m.tick(t0 + ms{1600});
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].what, membership_event::lost);
  EXPECT_EQ(lost[0].incarnation, 7u);
  EXPECT_FALSE(m.accepts(A, 7));
  // The frozen process wakes up and answers: dropped, counted, still lost.
  EXPECT_TRUE(m.answered(A, 7, devs(A), t0 + ms{2000}, false).empty());
  EXPECT_TRUE(m.answered(A, 7, devs(A), t0 + ms{2000}, true).empty());
  EXPECT_EQ(m.fenced_answers(), 2u);
  EXPECT_EQ(*m.state_of(A), member::state::lost);
  // Its restart is a new member at the same address.
  auto back = m.answered(A, 8, devs(A), t0 + ms{2100}, false);
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(back[0].what, membership_event::rejoined);
  EXPECT_EQ(back[0].incarnation, 8u);
  EXPECT_TRUE(m.accepts(A, 8));
  EXPECT_FALSE(m.accepts(A, 7));
}

TEST(Membership, ARestartFasterThanLostAfterIsALossThenARejoin) {
  membership m{ms{1500}};
  auto t0 = clock_type::now();
  m.answered(A, 1, devs(A), t0, true);
  EXPECT_EQ(
      kinds(m.answered(A, 2, devs(A), t0 + ms{100}, false)),
      (std::vector<membership_event::kind>{membership_event::lost, membership_event::rejoined}));
  EXPECT_TRUE(m.fenced(A, 1));
}

TEST(Membership, ManyMembersAreProbedWithinTheProbeBudgetAndLostAfterAsManyMissedProbes) {
  // At 200 ms per member, a thousand members cost the coordinator 10,000 messages a second
  // (about 40 % of a core here, BENCHMARKS.md): probes are bounded by probes_per_second, and a
  // member is lost after as many probes missed as with few members.
  troupe::cluster_options o;  // heartbeat 200 ms, lost_after 1,500 ms, 100 probes a second
  EXPECT_EQ(troupe::detail::probe_period(o, 3), ms{200});
  EXPECT_EQ(troupe::detail::probe_period(o, 20), ms{200});
  EXPECT_EQ(troupe::detail::probe_period(o, 1000), ms{10000});
  EXPECT_EQ(troupe::detail::scaled_lost_after(o, ms{10000}), ms{75000});
  o.probes_per_second = 1000;
  EXPECT_EQ(troupe::detail::probe_period(o, 200), ms{200});
  EXPECT_EQ(troupe::detail::probe_period(o, 1000), ms{1000});
  EXPECT_EQ(troupe::detail::probe_period(o, 1001), ms{1001});
  EXPECT_EQ(troupe::detail::scaled_lost_after(o, ms{200}), ms{1500});
  EXPECT_EQ(troupe::detail::scaled_lost_after(o, ms{1000}), ms{7500});
  {  // a day's lost_after, 1 ms heartbeats and one probe a second over 120 members: capped at
     // a year (it overflowed the clock, and every member was lost at once)
    auto x = o;
    x.heartbeat = ms{1};
    x.lost_after = std::chrono::hours{24};
    x.probes_per_second = 1;
    auto period = troupe::detail::probe_period(x, 120);
    EXPECT_EQ(period, ms{120000});
    EXPECT_EQ(troupe::detail::scaled_lost_after(x, period), std::chrono::hours{24 * 365});
  }
  o.probes_per_second = 0;  // no bound
  EXPECT_EQ(troupe::detail::probe_period(o, 100000), ms{200});
  // The member is not lost at 1.5 s once the period is longer, and is at the scaled time.
  membership m{o.lost_after};
  auto t0 = clock_type::now();
  m.answered(A, 1, devs(A), t0, true);
  m.set_lost_after(troupe::detail::scaled_lost_after(o, ms{1000}));
  EXPECT_TRUE(m.tick(t0 + ms{2000}).empty());
  EXPECT_EQ(kinds(m.tick(t0 + ms{7600})),
            (std::vector<membership_event::kind>{membership_event::lost}));
}

TEST(Membership, AMemberWhoseProcessIsGoneIsLostAtOnceOrDrainedWhenItSaidItWouldLeave) {
  // Its node actor went down (the process ended, or CAF closed its silent connection): no
  // waiting for lost_after, which many members stretch to tens of seconds.
  membership m{ms{75000}};
  auto t0 = clock_type::now();
  m.answered(A, 1, devs(A), t0, true);
  m.answered(B, 2, devs(B), t0, true);
  auto lost = m.gone(A);
  ASSERT_TRUE(lost);
  EXPECT_EQ(lost->what, membership_event::lost);
  EXPECT_TRUE(m.fenced(A, 1));
  EXPECT_FALSE(m.gone(A));  // once
  EXPECT_EQ(m.lost(), (std::vector<std::string>{A}));
  // One that said it drains (SIGTERM), then exited: drained, never lost (a rolling restart).
  m.answered(B, 2, devs(B), t0 + ms{100}, false, true);
  auto drained = m.gone(B);
  ASSERT_TRUE(drained);
  EXPECT_EQ(drained->what, membership_event::drained);
  EXPECT_FALSE(m.gone("127.0.0.1:9"));  // never a member
  // Its next process rejoins.
  EXPECT_EQ(kinds(m.answered(A, 3, devs(A), t0 + ms{200}, false)),
            (std::vector<membership_event::kind>{membership_event::rejoined}));
}

TEST(Membership, ANodeThatDrainsItselfIsDrainedNotLostAndItsNextProcessRejoins) {
  membership m{ms{1500}};
  auto t0 = clock_type::now();
  m.answered(A, 1, devs(A), t0, true);
  EXPECT_EQ(kinds(m.answered(A, 1, devs(A), t0 + ms{100}, false, true)),
            (std::vector<membership_event::kind>{membership_event::draining}));
  EXPECT_EQ(kinds(m.tick(t0 + ms{2000})),
            (std::vector<membership_event::kind>{membership_event::drained}));
  EXPECT_EQ(m.lost(), (std::vector<std::string>{A}));  // retried: a rolling restart
  EXPECT_EQ(kinds(m.answered(A, 2, devs(A), t0 + ms{2500}, false)),
            (std::vector<membership_event::kind>{membership_event::rejoined}));
  // Restarted before it went silent: drained, then rejoined (never lost).
  m.answered(A, 2, devs(A), t0 + ms{2600}, false, true);
  EXPECT_EQ(
      kinds(m.answered(A, 3, devs(A), t0 + ms{2700}, false)),
      (std::vector<membership_event::kind>{membership_event::drained, membership_event::rejoined}));
}

TEST(Membership, RemoveDrainsUntilTheRunnersAreDoneAndOnlyAddBringsItBack) {
  membership m{ms{1500}};
  auto t0 = clock_type::now();
  m.answered(A, 1, devs(A), t0, true);
  m.answered(B, 2, devs(B), t0, true);
  EXPECT_EQ(m.begin_drain(A).what, membership_event::draining);
  EXPECT_THROW(m.begin_drain(A), troupe::invalid_argument);
  EXPECT_TRUE(m.accepts(A, 1));  // its chunks in flight still count
  auto d = m.end_drain(A);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->what, membership_event::drained);
  EXPECT_TRUE(m.tick(t0 + ms{5000}).size() == 1u);  // B lost; A (drained) is not watched
  EXPECT_TRUE(m.answered(A, 1, devs(A), t0 + ms{5000}, false).empty());  // not by itself
  EXPECT_TRUE(m.lost() == std::vector<std::string>{B});
  EXPECT_EQ(kinds(m.answered(A, 1, devs(A), t0 + ms{5000}, true)),
            (std::vector<membership_event::kind>{membership_event::joined}));
  EXPECT_THROW(m.begin_drain("127.0.0.1:9"), troupe::invalid_argument);
}

TEST(Membership, AMemberThatRemoveDrainsNeverComesBackByItself) {
  membership m{ms{1500}};
  auto t0 = clock_type::now();
  m.answered(A, 1, devs(A), t0, true);
  m.begin_drain(A);
  // It drains itself meanwhile (SIGTERM), goes silent: drained, not lost.
  EXPECT_TRUE(m.answered(A, 1, devs(A), t0 + ms{100}, false, true).empty());
  EXPECT_EQ(kinds(m.tick(t0 + ms{2000})),
            (std::vector<membership_event::kind>{membership_event::drained}));
  EXPECT_FALSE(m.end_drain(A));
  EXPECT_TRUE(m.lost().empty());                                         // not retried
  EXPECT_TRUE(m.answered(A, 2, devs(A), t0 + ms{2500}, false).empty());  // its restart: no
  // Lost while remove() drained it: not retried either.
  m.answered(B, 5, devs(B), t0, true);
  m.begin_drain(B);
  EXPECT_EQ(kinds(m.tick(t0 + ms{2000})),
            (std::vector<membership_event::kind>{membership_event::lost}));
  EXPECT_TRUE(m.lost().empty());
  EXPECT_TRUE(m.answered(B, 6, devs(B), t0 + ms{2500}, false).empty());
  EXPECT_EQ(kinds(m.answered(B, 6, devs(B), t0 + ms{2600}, true)),
            (std::vector<membership_event::kind>{membership_event::joined}));
}
