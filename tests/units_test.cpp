// Devices, config, messages and the message-level testing support (docs/api.md: "Devices",
// "Configuration", "Message-level testing").
#include <gtest/gtest.h>
#include <sched.h>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/binary_deserializer.hpp>
#include <caf/binary_serializer.hpp>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <troupe/device_binding.hpp>
#include <troupe/internal/bulk.hpp>
#include <troupe/protocol.hpp>
#include <troupe/testing.hpp>

#include "test_jobs.hpp"

TEST(Device, ParsesAndPrintsBack) {
  for (const char* spec :
       {"cpu", "cuda", "cuda:0", "cuda:3", "cpu:1", "10.0.0.2:4242/cuda:1", "localhost:80/cpu"}) {
    troupe::device d{spec};
    EXPECT_EQ(d.str(), spec);
    EXPECT_EQ(troupe::device{d.str()}, d);
  }
  troupe::device gpu{"h:1/cuda:2"};
  EXPECT_TRUE(gpu.is_cuda());
  EXPECT_FALSE(gpu.is_cpu());
  EXPECT_EQ(gpu.index(), 2);
  EXPECT_EQ(gpu.node(), "h:1");
  EXPECT_EQ(gpu.local(), troupe::device{"cuda:2"});
  EXPECT_EQ(troupe::device{"cpu"}.index(), -1);
  EXPECT_EQ(troupe::device{"cpu"}.node(), "");
  std::vector<troupe::device> list{"cpu", "cuda:0"};
  EXPECT_EQ(list.size(), 2u);
  EXPECT_EQ(troupe::cpus(3), (std::vector<troupe::device>(3, "cpu")));
}

TEST(Device, MalformedSpecsThrowQuotingThem) {
  for (const char* spec :
       {"", "gpu", "cuda:", "cuda:x", "cuda:-1", "host/cpu", "h:99999/cpu", "h:1/tpu", "cpu:1:2"}) {
    try {
      troupe::device d{spec};
      ADD_FAILURE() << "accepted " << spec;
    } catch (const troupe::invalid_argument& e) {
      EXPECT_NE(std::string{e.what()}.find("'" + std::string{spec} + "'"), std::string::npos)
          << e.what();
    }
  }
}

TEST(Device, GpusNeverThrowAndMatchAvailability) {
  auto gpus = troupe::gpus();  // no driver here: empty, never a crash
  for (auto& d : gpus) EXPECT_TRUE(d.is_cuda());
  if (gpus.empty()) {
    EXPECT_FALSE(troupe::why_unavailable("cuda:0").empty());
  }
  EXPECT_TRUE(troupe::why_unavailable("cpu").empty());
}

#ifndef TROUPE_WITH_TORCH
TEST(Device, WithoutTheTorchComponentCudaDevicesAreUnavailable) {
  // This binary links only troupe::troupe: no CUDA support is installed.
  EXPECT_EQ(troupe::detail::cuda_device_count(), -1);
  EXPECT_TRUE(troupe::gpus().empty());
  try {
    troupe::unordered_runner<test_jobs::squares> runner{std::vector<troupe::device>{"cuda:0"}};
    FAIL() << "a cuda:0 producer started without troupe::torch";
  } catch (const troupe::device_unavailable& e) {
    EXPECT_NE(std::string{e.what()}.find("troupe::torch"), std::string::npos) << e.what();
  }
}
#endif

TEST(Device, UsableCoresFollowTheAffinityMaskAndTheCgroupQuota) {
  // The default intra-op budget and the consumer threads count the cores the process may use:
  // hardware_concurrency() counts the machine's (a pod limited to 2 CPUs on 64 cores ran 64
  // threads per CPU producer).
  using troupe::detail::cores_of_cpu_max;
  EXPECT_EQ(cores_of_cpu_max("max 100000"), 0);
  EXPECT_EQ(cores_of_cpu_max("100000 100000"), 1);
  EXPECT_EQ(cores_of_cpu_max("150000 100000"), 2) << "a part of a core is rounded up";
  EXPECT_EQ(cores_of_cpu_max("50000 100000"), 1);
  EXPECT_EQ(cores_of_cpu_max("-1 100000"), 0) << "cgroup v1's quota of -1: no limit";
  EXPECT_EQ(cores_of_cpu_max(""), 0);
  auto machine = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto all = troupe::detail::usable_cores();
  EXPECT_GE(all, 1);
  EXPECT_LE(all, machine);
  if (machine < 2) GTEST_SKIP() << "one core: no affinity mask narrower than the machine";
  int pinned = 0;
  std::thread t{[&] {  // sched_getaffinity(0) is the calling thread's mask
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(0, &one);
    if (::sched_setaffinity(0, sizeof one, &one) == 0) pinned = troupe::detail::usable_cores();
  }};
  t.join();
  EXPECT_EQ(pinned, 1) << "a thread allowed one CPU counted " << pinned;
}

TEST(Device, OmpNumThreadsCapsTheDefaultThreadBudget) {
  using troupe::detail::omp_threads_cap;
  EXPECT_EQ(omp_threads_cap(nullptr), 0);
  EXPECT_EQ(omp_threads_cap(""), 0);
  EXPECT_EQ(omp_threads_cap("4"), 4);
  EXPECT_EQ(omp_threads_cap("4,2"), 4) << "a list of levels: the first";
  EXPECT_EQ(omp_threads_cap("0"), 0);
  EXPECT_EQ(omp_threads_cap("-3"), 0);
  EXPECT_EQ(omp_threads_cap("two"), 0);
  EXPECT_EQ(omp_threads_cap("8 threads"), 0);
}

TEST(Config, TypedGetSetAndNesting) {
  troupe::config cfg;
  cfg.set("flag", true).set("n", 42).set("x", 2.5).set("name", "squares");
  cfg.set("model.width", 64).set("model.layers", std::vector<int>{3, 4});
  cfg.set("names", std::vector<std::string>{"a", "b"});
  EXPECT_TRUE(cfg.get<bool>("flag"));
  EXPECT_EQ(cfg.get<int>("n"), 42);
  EXPECT_EQ(cfg.get<std::uint8_t>("n"), 42);
  EXPECT_DOUBLE_EQ(cfg.get<double>("x"), 2.5);
  EXPECT_DOUBLE_EQ(cfg.get<double>("n"), 42.0);
  EXPECT_EQ(cfg.get<std::string>("name"), "squares");
  EXPECT_EQ(cfg.get<int>("model.width"), 64);
  EXPECT_EQ(cfg.get<std::vector<int>>("model.layers"), (std::vector<int>{3, 4}));
  EXPECT_EQ(cfg.get<std::vector<std::string>>("names"), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(cfg.get<troupe::config>("model").get<int>("width"), 64);
  EXPECT_TRUE(cfg.contains("model.width"));
  EXPECT_TRUE(cfg.contains("model"));
  EXPECT_FALSE(cfg.contains("model.depth"));
  EXPECT_EQ(cfg.get_or("model.depth", 7), 7);
}

TEST(Config, MissingKeysAndWrongTypesThrowConfigError) {
  troupe::config cfg;
  cfg.set("n", 300).set("s", "text");
  EXPECT_THROW((void)cfg.get<int>("missing"), troupe::config_error);
  EXPECT_THROW((void)cfg.get<int>("s"), troupe::config_error);
  EXPECT_THROW((void)cfg.get<std::uint8_t>("n"), troupe::config_error);  // out of range
  EXPECT_THROW((void)cfg.get_or<std::string>("n", "x"), troupe::config_error);
  try {
    (void)cfg.get<int>("missing");
  } catch (const troupe::config_error& e) {
    EXPECT_NE(std::string{e.what()}.find("'missing'"), std::string::npos);
  }
}

namespace {

template <class T>
T round_trip(caf::actor_system& sys, T x) {
  std::vector<char> buf;
  caf::binary_serializer sink{sys, buf};
  auto err = sink(x);
  EXPECT_FALSE(err) << sys.render(err);
  T y;
  caf::binary_deserializer source{sys, buf};
  err = source(y);
  EXPECT_FALSE(err) << sys.render(err);
  return y;
}

}  // namespace

TEST(Messages, ConfigDeviceAndChunksSerialize) {
  caf::actor_system_config sys_cfg;
  caf::actor_system sys{sys_cfg};
  troupe::config cfg;
  cfg.set("a.b", 1).set("s", "x");
  EXPECT_EQ(round_trip(sys, cfg), cfg);
  EXPECT_EQ(round_trip(sys, troupe::device{"h:1/cuda:3"}), troupe::device{"h:1/cuda:3"});

  troupe::register_batch_type<std::int64_t>("test.i64");
  troupe::work_chunk w{3, 10, troupe::batch::of<std::int64_t>({1, 2, 3})};
  auto w2 = round_trip(sys, w);
  EXPECT_EQ(w2.run, 3u);
  EXPECT_EQ(w2.first, 10u);
  ASSERT_NE(w2.items.as<std::int64_t>(), nullptr);
  EXPECT_EQ(w2.items.as<std::int64_t>()->items, (std::vector<std::int64_t>{1, 2, 3}));

  troupe::chunk_result r{3, 10, {}, 5, 7, troupe::errc::work_error, 12, "boom", {}};
  auto r2 = round_trip(sys, r);
  EXPECT_EQ(r2.code, troupe::errc::work_error);
  EXPECT_EQ(r2.busy_ns, 5);
  EXPECT_EQ(r2.idle_ns, 7);
  EXPECT_EQ(r2.failed_index, 12u);
  EXPECT_EQ(r2.what, "boom");
  EXPECT_FALSE(r2.outputs);

  // A batch of an unregistered type cannot cross the network: an error, not a crash.
  std::vector<char> buf;
  caf::binary_serializer sink{sys, buf};
  troupe::work_chunk unregistered{1, 0, troupe::batch::of<short>({1})};
  EXPECT_TRUE(sink(unregistered));
  // Bytes naming an unknown type are refused on load.
  std::vector<char> bogus;
  caf::binary_serializer bogus_sink{sys, bogus};
  std::uint64_t run = 1, first = 0;
  std::string name = "no.such.type";
  EXPECT_FALSE(bogus_sink(run, first, name));
  troupe::work_chunk loaded;
  caf::binary_deserializer source{sys, bogus};
  EXPECT_TRUE(source(loaded));
}

TEST(Messages, ErrorsKeepCodeAndText) {
  auto err = troupe::make_error(troupe::errc::init_error, "weights missing");
  EXPECT_EQ(troupe::error_code(err), troupe::errc::init_error);
  EXPECT_EQ(troupe::error_text(err), "weights missing");
  EXPECT_STREQ(troupe::to_string(troupe::errc::node_error), "node_error");
  EXPECT_THROW(troupe::throw_error(troupe::errc::config_error, "x"), troupe::config_error);
}

TEST(Testing, ProducerProbeAnswersWorkMessages) {
  troupe::config cfg;
  cfg.set("bad", 5);
  troupe::testing::producer_probe<test_jobs::throws_on_item> probe{"cpu", cfg};
  EXPECT_EQ(probe.work({1, 2, 3}), (std::vector<std::int64_t>{1, 2, 3}));
  auto r = probe.send(troupe::work_chunk{9, 100, troupe::batch::of<std::int64_t>({4, 5, 6})});
  EXPECT_EQ(r.run, 9u);
  EXPECT_EQ(r.code, troupe::errc::work_error);
  EXPECT_EQ(r.failed_index, 101u);
  EXPECT_NE(r.what.find("cannot handle 5"), std::string::npos);
  // A chunk of the wrong item type is a protocol error, not a crash.
  auto wrong = probe.send(troupe::work_chunk{9, 0, troupe::batch::of<std::string>({"x"})});
  EXPECT_EQ(wrong.code, troupe::errc::protocol_error);
  try {
    probe.work({7, 5}, 20);
    FAIL();
  } catch (const troupe::work_error& e) {
    EXPECT_EQ(e.index(), 21u);
  }
  probe.end();
  EXPECT_EQ(probe.send(troupe::work_chunk{1, 0, troupe::batch::of<std::int64_t>({1})}).code,
            troupe::errc::protocol_error);
}

TEST(Testing, ProducerProbeReportsInitFailures) {
  test_jobs::init_attempts = 1;  // the next construction is the "second": it throws
  EXPECT_THROW(troupe::testing::producer_probe<test_jobs::second_init_throws>{},
               troupe::init_error);
  if (troupe::gpus().empty()) {
    EXPECT_THROW(troupe::testing::producer_probe<test_jobs::squares>{"cuda:0"},
                 troupe::device_unavailable);
  }
}

TEST(Testing, ConsumerProbe) {
  troupe::testing::consumer_probe<test_jobs::squares> probe;
  probe.work({1, 4});
  probe.work({9});
  EXPECT_EQ(probe.end(), 14);
  troupe::testing::consumer_probe<test_jobs::consumer_throws> failing;
  EXPECT_THROW(failing.work({169}), troupe::consumer_error);
  EXPECT_THROW(failing.end(), troupe::consumer_error);
}

// The scheduler sends a consumer its chunks as plain messages: each is counted in the job's
// gate, and acknowledged with a message only when the scheduler waits for one (its backlog is
// full, or the job has nothing left but its consumer's chunks) and for the last, so that a chunk
// does not wake the scheduler's thread a second time.
TEST(Consumer, AcknowledgesAPlainChunkOnlyWhenTheSchedulerWaitsForItAndTheLast) {
  troupe::testing::test_system ts;
  caf::scoped_actor self{ts.get()};
  auto slot = std::make_shared<std::optional<std::int64_t>>();
  auto gate = std::make_shared<troupe::detail::job_gate>();
  auto consumer = troupe::detail::spawn_consumer_actor(
      ts.get(), troupe::detail::make_consumer_maker<test_jobs::squares>(slot), {}, gate);
  auto chunk = [](std::vector<std::int64_t> v, bool last = false) {
    return troupe::consume_chunk{7, troupe::batch::of(std::move(v)), last};
  };
  auto acks = [&] {  // the acknowledgements in this actor's mailbox now
    int n = 0;
    bool more = true;
    while (more)
      self->receive([&](const troupe::consume_ack& a) { n += a.run == 7 ? 1 : 100; },
                    caf::after(std::chrono::seconds{0}) >> [&] { more = false; });
    return n;
  };
  auto taken = [&](std::uint64_t chunks) {  // waits until the consumer has taken `chunks`
    while (gate->chunks_done() < chunks) std::this_thread::yield();
  };
  self->send(consumer, chunk({1, 2}));
  self->send(consumer, chunk({3}));
  self->send(consumer, chunk({4, 5, 6}));
  taken(3);
  EXPECT_EQ(gate->delivered(), 6u);
  // Another message after them, answered: the three chunks' answers, had there been any, came
  // before it.
  self->request(consumer, caf::infinite, chunk({}))
      .receive([](const troupe::consume_ack&) {}, [](caf::error&) { FAIL(); });
  EXPECT_EQ(acks(), 0) << "a chunk the scheduler did not wait for was acknowledged";
  gate->want_ack(true);
  self->send(consumer, chunk({7}));
  taken(5);
  self->request(consumer, caf::infinite, chunk({}))
      .receive([](const troupe::consume_ack&) {}, [](caf::error&) { FAIL(); });
  EXPECT_EQ(acks(), 1);
  gate->want_ack(false);
  self->send(consumer, chunk({8}, true));
  self->receive([](const troupe::consume_ack& a) { EXPECT_EQ(a.run, 7u); });
  EXPECT_EQ(gate->chunks_done(), 7u);
  EXPECT_EQ(gate->delivered(), 8u);
  EXPECT_EQ(*slot, std::optional<std::int64_t>{1 + 2 + 3 + 4 + 5 + 6 + 7 + 8});
}

TEST(Messages, TruncatedOrLyingBatchesFailToLoad) {
  caf::actor_system_config sys_cfg;
  caf::actor_system sys{sys_cfg};
  troupe::register_batch_type<std::int64_t>();
  std::vector<char> buf;
  caf::binary_serializer sink{sys, buf};
  troupe::work_chunk w{1, 0, troupe::batch::of<std::int64_t>(std::vector<std::int64_t>(1000, 7))};
  ASSERT_FALSE(sink(w));
  std::vector<char> part(buf.begin(), buf.end() - 8);
  troupe::work_chunk back;
  caf::binary_deserializer source{sys, part};
  EXPECT_TRUE(source(back));
  // A count of 2^60 items with nothing behind it: refused before allocating.
  std::vector<char> lie;
  caf::binary_serializer liar{sys, lie};
  std::uint64_t run = 1, first = 0, count = std::uint64_t{1} << 60;
  std::string name = typeid(std::int64_t).name();
  ASSERT_FALSE(liar(run, first, name, count));
  caf::binary_deserializer lie_source{sys, lie};
  EXPECT_TRUE(lie_source(back));
}

namespace {

/// Sends `b` the way a peer does when it is large: every fragment, then the reference, each
/// through CAF's binary serializers; `skip` names a fragment to lose on the way.
troupe::batch through_fragments(caf::actor_system& sys, const troupe::batch& b,
                                std::size_t* fragments = nullptr, std::uint64_t skip = ~0ull) {
  auto p = troupe::bulk::payload::capture(b);
  auto id = troupe::bulk::next_stream_id();
  std::uint64_t n = 0;
  for (std::uint64_t off = 0; off < p->size(); off += troupe::bulk::fragment_bytes, ++n) {
    auto len = std::min<std::uint64_t>(troupe::bulk::fragment_bytes, p->size() - off);
    troupe::bulk::fragment f{id, off, p->size(), len, p};
    std::vector<char> buf;
    caf::binary_serializer sink{sys, buf};
    EXPECT_FALSE(sink(f));
    if (n == skip) continue;
    troupe::bulk::fragment back;
    caf::binary_deserializer source{sys, buf};
    EXPECT_FALSE(source(back));
    EXPECT_EQ(back.size, len);
  }
  if (fragments) *fragments = n;
  auto ref = round_trip(sys, troupe::bulk::reference(id, p->size(), b.size()));
  EXPECT_EQ(troupe::bulk::stream_of(ref), id);
  return troupe::bulk::resolve(ref);
}

}  // namespace

TEST(BulkPayloads, LargeBatchesAreSplitAndJoinedExactly) {
  caf::actor_system_config sys_cfg;
  caf::actor_system sys{sys_cfg};
  troupe::register_batch_type<std::int64_t>();
  troupe::register_batch_type<std::string>();

  std::vector<std::int64_t> numbers(300'000);  // one 2.4 MB raw block, sent by reference
  for (std::size_t i = 0; i < numbers.size(); ++i) numbers[i] = static_cast<std::int64_t>(i * i);
  std::size_t fragments = 0;
  auto back = through_fragments(sys, troupe::batch::of(numbers), &fragments);
  EXPECT_EQ(fragments, 3u);
  ASSERT_NE(back.as<std::int64_t>(), nullptr);
  EXPECT_EQ(back.as<std::int64_t>()->items, numbers);

  std::vector<std::string> words;  // many small values, copied inline
  for (int i = 0; i < 60'000; ++i)
    words.push_back(std::string(static_cast<std::size_t>(i % 37), 'a' + i % 26));
  auto back_words = through_fragments(sys, troupe::batch::of(words), &fragments);
  EXPECT_GE(fragments, 2u);
  ASSERT_NE(back_words.as<std::string>(), nullptr);
  EXPECT_EQ(back_words.as<std::string>()->items, words);

  auto small = through_fragments(sys, troupe::batch::of<std::int64_t>({4, 5}), &fragments);
  EXPECT_EQ(fragments, 1u);
  EXPECT_EQ(small.as<std::int64_t>()->items, (std::vector<std::int64_t>{4, 5}));
  EXPECT_EQ(troupe::bulk::pending_streams(), 0u);
}

TEST(BulkPayloads, LostLyingOrUnknownFragmentsAreErrors) {
  caf::actor_system_config sys_cfg;
  caf::actor_system sys{sys_cfg};
  troupe::register_batch_type<std::int64_t>();
  auto big = troupe::batch::of(std::vector<std::int64_t>(400'000, 3));
  // A lost fragment: the reference fails to resolve, and nothing stays behind.
  EXPECT_THROW(through_fragments(sys, big, nullptr, 1), troupe::protocol_error);
  EXPECT_EQ(troupe::bulk::pending_streams(), 0u);
  // A reference whose fragments never came.
  EXPECT_THROW(troupe::bulk::resolve(troupe::bulk::reference(42, 4096, 1)), troupe::protocol_error);

  auto load = [&](std::uint64_t offset, std::uint64_t total, std::uint64_t size, std::size_t bytes,
                  std::uint64_t stream = troupe::bulk::next_stream_id()) {
    std::vector<char> buf;
    caf::binary_serializer sink{sys, buf};
    EXPECT_FALSE(sink(stream, offset, total, size));
    buf.resize(buf.size() + bytes, 'x');
    troupe::bulk::fragment f;
    caf::binary_deserializer source{sys, buf};
    return source(f);
  };
  auto id = troupe::bulk::next_stream_id();
  EXPECT_FALSE(load(0, 10, 10, 10, id));  // well formed, but its bytes are no batch
  EXPECT_THROW(troupe::bulk::resolve(troupe::bulk::reference(id, 10, 1)), troupe::protocol_error);
  EXPECT_TRUE(load(8, 10, 4, 4));                             // past its stream's end
  EXPECT_TRUE(load(0, 1 << 20, 1 << 20, 100));                // more than it holds
  EXPECT_TRUE(load(0, troupe::bulk::max_total + 1, 10, 10));  // a stream too large
  EXPECT_TRUE(load(~0ull - 5, ~0ull, 10, 10));                // offsets that overflow
  EXPECT_EQ(troupe::bulk::pending_streams(), 0u);
}
