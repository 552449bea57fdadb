// Serialization a user can test (troupe::testing::round_trip, options::serialize, the probe's
// serialize option), producer identity (the index a producer's constructor may take) and
// producer events reported without a log handler (options::on_event).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <troupe/node.hpp>
#include <troupe/testing.hpp>
#include <troupe/troupe.hpp>
#include <vector>

#include "test_jobs.hpp"
#include "test_util.hpp"

namespace {

// Two versions of one item: the first one's inspect() forgets `label`, the second is fixed.
struct broken_item {
  std::int64_t id = 0;
  std::string label;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, broken_item& x) {
  return f(caf::meta::type_name("test.broken_item"), x.id);  // `label` forgotten
}

struct fixed_item {
  std::int64_t id = 0;
  std::string label;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, fixed_item& x) {
  return f(caf::meta::type_name("test.fixed_item"), x.id, x.label);
}

/// Sums the lengths of the items' labels: an item that lost its label adds 0.
template <class Item>
struct label_lengths {
  struct producer {
    std::int64_t work(const Item& x) { return static_cast<std::int64_t>(x.label.size()) + x.id; }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

template <class Item>
std::vector<Item> labelled(int n) {
  std::vector<Item> xs;
  for (int i = 0; i < n; ++i)
    xs.push_back(Item{i, std::string(static_cast<std::size_t>(i % 7), 'x')});
  return xs;
}

template <class Item>
std::int64_t expected_sum(int n) {
  std::int64_t sum = 0;
  for (auto& x : labelled<Item>(n)) sum += x.id + static_cast<std::int64_t>(x.label.size());
  return sum;
}

}  // namespace

TEST(Serialization, RoundTripLosesTheFieldABrokenInspectForgets) {
  broken_item b{7, "seven"};
  auto copy = troupe::testing::round_trip(b);
  EXPECT_EQ(copy.id, 7);
  EXPECT_NE(copy.label, b.label);  // what a node would have received
  EXPECT_TRUE(copy.label.empty());
}

TEST(Serialization, RoundTripKeepsEveryFieldOnceTheFieldIsAdded) {
  fixed_item f{7, "seven"};
  auto copy = troupe::testing::round_trip(f);
  EXPECT_EQ(copy.id, 7);
  EXPECT_EQ(copy.label, "seven");
  // Numbers, strings and containers travel as they are.
  EXPECT_EQ(troupe::testing::round_trip(std::int64_t{-5}), -5);
  EXPECT_EQ(troupe::testing::round_trip(std::string{"abc"}), "abc");
  EXPECT_EQ(troupe::testing::round_trip(std::vector<double>{1.5, 2.5}),
            (std::vector<double>{1.5, 2.5}));
}

TEST(Serialization, TheSerializeOptionShowsABrokenInspectInALocalRun) {
  constexpr int n = 1000;
  auto xs = labelled<broken_item>(n);
  // Without the option, nothing is serialized locally: the bug stays hidden.
  troupe::unordered_runner<label_lengths<broken_item>> plain{2};
  EXPECT_EQ(plain.run(xs), expected_sum<broken_item>(n));
  // With it, every chunk crosses the wire format: the labels are lost as on a node.
  troupe::options opts;
  opts.serialize = true;
  troupe::unordered_runner<label_lengths<broken_item>> wire{2, {}, opts};
  EXPECT_NE(wire.run(xs), expected_sum<broken_item>(n));
  EXPECT_EQ(wire.run(xs), static_cast<std::int64_t>(n) * (n - 1) / 2);  // ids only
}

TEST(Serialization, TheSerializeOptionPassesOnceTheFieldIsAdded) {
  constexpr int n = 1000;
  troupe::options opts;
  opts.serialize = true;
  troupe::ordered_runner<label_lengths<fixed_item>> wire{2, {}, opts};
  EXPECT_EQ(wire.run(labelled<fixed_item>(n)), expected_sum<fixed_item>(n));
}

namespace {

// A struct of plain data with no inspect(): its items cross the network as one block of bytes.
struct point {
  std::int32_t x = 0;
  std::int32_t y = 0;
  std::int64_t id = 0;
};
struct padded {  // 3 bytes of padding after `c`: not plain (its padding would be sent)
  char c = 0;
  std::int32_t i = 0;
};
struct holds_a_string {
  std::string s;
};
static_assert(troupe::detail::plain_struct<point>);
static_assert(troupe::detail::wire_serializable<point>);
static_assert(!troupe::detail::plain_struct<padded>);
static_assert(!troupe::detail::plain_struct<holds_a_string>);
static_assert(!troupe::detail::plain_struct<std::int64_t>);  // numbers are raw_items already

struct moved_points {
  struct producer {
    point work(point p) { return point{p.x + 1, p.y * 2, p.id}; }
  };
  struct consumer {
    void work(point p) { sum += p.x + p.y + p.id; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

std::vector<point> some_points(int n) {
  std::vector<point> out;
  for (int i = 0; i < n; ++i) out.push_back(point{i, -i, 1000 + i});
  return out;
}
std::int64_t moved_sum(int n) {
  std::int64_t s = 0;
  for (int i = 0; i < n; ++i) s += (i + 1) + (-i * 2) + (1000 + i);
  return s;
}

}  // namespace

TROUPE_REGISTER_JOB(moved_points);

TEST(Serialization, PlainStructsCrossTheWireAsOneBlockOfBytes) {
  auto back = troupe::testing::round_trip(point{3, -4, 1234567890123});
  EXPECT_EQ(back.x, 3);
  EXPECT_EQ(back.y, -4);
  EXPECT_EQ(back.id, 1234567890123);
  // Their payload is their bytes (what troupe_node_payload_bytes_total counts).
  auto b = troupe::batch::of(some_points(100));
  ASSERT_TRUE(b.get()->flat_bytes());
  EXPECT_EQ(*b.get()->flat_bytes(), 100 * sizeof(point));
  // A local run through the wire format, as on a node.
  troupe::options opts;
  opts.serialize = true;
  troupe::ordered_runner<moved_points> wire{2, {}, opts};
  EXPECT_EQ(wire.run(some_points(5000)), moved_sum(5000));
}

TEST(Serialization, PlainStructsThroughANodeGiveTheExactResult) {
  test_util::watchdog dog{std::chrono::seconds{60}, "plain structs through a node"};
  auto node = troupe::node::serve("127.0.0.1:0", {"cpu", "cpu"});
  auto at = node.address();
  troupe::unordered_runner<moved_points> runner{
      {troupe::device{at + "/cpu"}, troupe::device{at + "/cpu"}}};
  EXPECT_EQ(runner.run(some_points(20000)), moved_sum(20000));
}

TEST(Serialization, TheProbeCanSerializeToo) {
  troupe::testing::probe_options o;
  o.serialize = true;
  troupe::testing::producer_probe<label_lengths<broken_item>> broken{"cpu", {}, o};
  EXPECT_EQ(broken.work({broken_item{1, "abc"}}), (std::vector<std::int64_t>{1}));
  troupe::testing::producer_probe<label_lengths<fixed_item>> fixed{"cpu", {}, o};
  EXPECT_EQ(fixed.work({fixed_item{1, "abc"}}), (std::vector<std::int64_t>{4}));
}

namespace {
struct not_serializable {  // no inspect(), and not plain data (it holds a string)
  std::int64_t x = 0;
  std::string label;
};
struct unserializable_job {
  struct producer {
    std::int64_t work(const not_serializable& v) { return v.x; }
  };
};
}  // namespace

TEST(Serialization, TheSerializeOptionRefusesTypesWithoutInspect) {
  troupe::options opts;
  opts.serialize = true;
  EXPECT_THROW((troupe::unordered_runner<unserializable_job>{1, {}, opts}),
               troupe::invalid_argument);
}

// -- producer identity ---------------------------------------------------------------------------

namespace {
struct which_producer {
  struct producer {
    producer(const troupe::device&, const troupe::config&, std::size_t index) : index(index) {}
    std::int64_t work(std::int64_t) { return static_cast<std::int64_t>(index); }
    std::size_t index;
  };
  struct consumer {
    void work(std::int64_t i) { seen.insert(i); }
    std::set<std::int64_t> end() { return seen; }
    std::set<std::int64_t> seen;
  };
};
}  // namespace

TEST(ProducerIdentity, EachProducerKnowsItsIndexAndStatsCarryIt) {
  troupe::options opts;
  opts.chunk_size = 1;
  troupe::unordered_runner<which_producer> runner{3, {}, opts};
  std::set<std::int64_t> seen;
  // Every index is one of 0, 1, 2; run until each has answered at least once (bounded).
  for (int round = 0; round < 200 && seen.size() < 3; ++round) {
    auto s = runner.run(test_util::iota(300));
    seen.insert(s.begin(), s.end());
  }
  EXPECT_EQ(seen, (std::set<std::int64_t>{0, 1, 2}));
  auto st = runner.stats();
  ASSERT_EQ(st.producers.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(st.producers[i].index, i);
}

namespace {
/// A third constructor parameter with a default that is not an index: it keeps its default.
struct defaulted_flag {
  struct producer {
    producer(const troupe::device&, const troupe::config&, bool verbose = false)
        : verbose(verbose) {}
    std::int64_t work(std::int64_t) { return verbose ? 1 : 0; }
    bool verbose;
  };
};
}  // namespace

TEST(ProducerIdentity, ADefaultedThirdParameterIsNotHandedTheIndex) {
  troupe::options opts;
  opts.chunk_size = 1;
  troupe::unordered_runner<defaulted_flag> runner{3, {}, opts};
  for (auto v : runner.run(test_util::iota(300))) ASSERT_EQ(v, 0);
}

TEST(ProducerIdentity, TheProbePassesTheIndex) {
  troupe::testing::probe_options o;
  o.index = 5;
  troupe::testing::producer_probe<which_producer> p{"cpu", {}, o};
  EXPECT_EQ(p.work({0, 0}), (std::vector<std::int64_t>{5, 5}));
}

// -- producer events -----------------------------------------------------------------------------

namespace {
std::atomic<bool> stalled_once{false};
/// The first item ever worked on stalls its producer for config "stall_ms".
struct stalls_once {
  struct producer {
    explicit producer(const troupe::device&, const troupe::config& cfg)
        : stall(cfg.get<std::int64_t>("stall_ms")) {}
    std::int64_t work(std::int64_t x) {
      if (!stalled_once.exchange(true))
        std::this_thread::sleep_for(std::chrono::milliseconds{stall});
      return x;
    }
    std::int64_t stall;
  };
};

struct event_log {
  std::mutex mtx;
  std::vector<troupe::producer_event> events;
  std::function<void(const troupe::producer_event&)> handler() {
    return [this](const troupe::producer_event& e) {
      std::lock_guard<std::mutex> guard{mtx};
      events.push_back(e);
    };
  }
  std::size_t count(troupe::producer_event::kind k) {
    std::lock_guard<std::mutex> guard{mtx};
    std::size_t n = 0;
    for (auto& e : events) n += e.what == k ? 1 : 0;
    return n;
  }
};
}  // namespace

TEST(ProducerEvents, AQuarantinedProducerIsReportedWithoutALogHandler) {
  test_jobs::bad_producers = 0;
  event_log log;
  troupe::options opts;
  opts.quarantine_after = 3;
  opts.chunk_size = 1;
  opts.on_event = log.handler();
  troupe::ordered_runner<test_jobs::one_bad_producer> runner{3, {}, opts};
  troupe::job_options o;
  o.on_error = troupe::error_policy::retry(3);
  EXPECT_EQ(runner.run(test_util::iota(300), o), test_util::iota(300));
  ASSERT_EQ(log.count(troupe::producer_event::kind::quarantined), 1u);
  std::lock_guard<std::mutex> guard{log.mtx};
  auto& e = log.events.front();
  EXPECT_EQ(e.what, troupe::producer_event::kind::quarantined);
  EXPECT_TRUE(runner.stats().producers.at(e.producer).quarantined);
  EXPECT_EQ(e.where, troupe::device{"cpu"});
  EXPECT_NE(e.reason.find("quarantine_after"), std::string::npos) << e.reason;
}

TEST(ProducerEvents, ATimedOutProducerAndItsReplacementAreReported) {
  stalled_once = false;
  event_log log;
  troupe::options opts;
  // 600 ms: a healthy producer held that long by a loaded machine would be timed out too.
  opts.work_timeout = std::chrono::milliseconds{600};
  opts.speculative = false;  // else the idle producer takes the stuck chunk and the job ends first
  opts.chunk_size = 1;
  opts.on_event = log.handler();
  troupe::config cfg;
  cfg.set("stall_ms", 3000);
  troupe::ordered_runner<stalls_once> runner{2, cfg, opts};
  EXPECT_EQ(runner.run(test_util::iota(50)), test_util::iota(50));
  EXPECT_EQ(log.count(troupe::producer_event::kind::timed_out), 1u);
  // The replacement starts in the background: wait for its event (bounded).
  for (int i = 0; i < 500 && log.count(troupe::producer_event::kind::replaced) == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  EXPECT_EQ(log.count(troupe::producer_event::kind::replaced), 1u);
  EXPECT_EQ(log.count(troupe::producer_event::kind::lost), 0u);
}

TEST(ProducerEvents, AHandlerMayCloseTheRunnerWithoutWaitingForItself) {
  // on_event runs on the scheduler's thread: close() from there only starts closing (it would
  // otherwise wait for that very thread), and the job still running ends with runner_closed.
  test_jobs::bad_producers = 0;
  troupe::options opts;
  opts.quarantine_after = 2;
  opts.chunk_size = 1;
  std::atomic<int> events{0};
  troupe::ordered_runner<test_jobs::one_bad_producer>* self = nullptr;
  opts.on_event = [&](const troupe::producer_event&) {
    ++events;
    self->close();
  };
  troupe::ordered_runner<test_jobs::one_bad_producer> runner{2, {}, opts};
  self = &runner;
  troupe::job_options o;
  o.on_error = troupe::error_policy::retry(5);
  // The job either finished before the close took effect or was ended by it; it never hangs.
  try {
    auto out = runner.run(test_util::iota(2000), o);
    EXPECT_EQ(out, test_util::iota(2000));
  } catch (const troupe::runner_closed&) {
  }
  EXPECT_GE(events.load(), 1);
  EXPECT_FALSE(runner.is_open());
}

TEST(Serialization, SimulatedRunnersSerializeToo) {
  constexpr int n = 100;
  troupe::testing::simulation sim{1};
  sim.nodes({"a:1"}, troupe::cpus(2));
  troupe::options opts;
  opts.serialize = true;
  auto wire = sim.unordered_runner<label_lengths<broken_item>>(sim.devices(), {}, opts);
  EXPECT_EQ(wire.run(labelled<broken_item>(n)), static_cast<std::int64_t>(n) * (n - 1) / 2);
  EXPECT_THROW((void)sim.unordered_runner<unserializable_job>(sim.devices(), {}, opts),
               troupe::invalid_argument);
}
