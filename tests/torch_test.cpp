// Tensors as payloads (wire format, validation) and the GPU paths (skipped without a GPU).
#include <dirent.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/binary_deserializer.hpp>
#include <caf/binary_serializer.hpp>
#include <cstdlib>
#include <iostream>
#include <set>
#include <thread>
#include <troupe/device_binding.hpp>
#include <troupe/protocol.hpp>
#include <troupe/testing.hpp>
#include <troupe/torch.hpp>
#include <troupe/troupe.hpp>

namespace {

at::Tensor round_trip(const at::Tensor& t) {
  return troupe::from_wire(troupe::to_wire(t));
}

void expect_same(const at::Tensor& a, const at::Tensor& b) {
  EXPECT_EQ(a.scalar_type(), b.scalar_type());
  EXPECT_EQ(a.sizes(), b.sizes());
  EXPECT_TRUE(torch::equal(a, b));
}

}  // namespace

TEST(Tensor, RoundTripsEveryDtypeAndShape) {
  for (auto type : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kInt, at::kLong,
                    at::kShort, at::kChar, at::kByte, at::kBool, at::kComplexFloat}) {
    auto t = (torch::rand({3, 4}) * 10).to(type);
    expect_same(round_trip(t), t);
  }
  expect_same(round_trip(torch::tensor(3.5)), torch::tensor(3.5));      // 0-dim
  expect_same(round_trip(torch::empty({0, 5})), torch::empty({0, 5}));  // empty
  auto base = torch::arange(24, torch::kFloat).reshape({4, 6});
  auto strided = base.t().slice(0, 1, 5, 2);  // not contiguous
  ASSERT_FALSE(strided.is_contiguous());
  expect_same(round_trip(strided), strided.contiguous());
}

TEST(Tensor, BadWireFormsAreErrorsNotCrashes) {
  auto w = troupe::to_wire(torch::ones({2, 3}));
  auto short_bytes = w;
  short_bytes.bytes.resize(5);
  EXPECT_THROW(troupe::from_wire(short_bytes), troupe::protocol_error);
  auto long_bytes = w;
  long_bytes.bytes.resize(1000);
  EXPECT_THROW(troupe::from_wire(long_bytes), troupe::protocol_error);
  auto negative = w;
  negative.shape = {-2, -3};
  EXPECT_THROW(troupe::from_wire(negative), troupe::protocol_error);
  auto huge = w;
  huge.shape = {1LL << 40, 1LL << 40, 1LL << 40};
  EXPECT_THROW(troupe::from_wire(huge), troupe::protocol_error);
  auto bad_type = w;
  bad_type.dtype = 99;
  EXPECT_THROW(troupe::from_wire(bad_type), troupe::protocol_error);
}

TEST(Tensor, SerializesThroughCafInspectors) {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  troupe::register_batch_type<at::Tensor>("test.tensor");
  troupe::work_chunk w{1, 0,
                       troupe::batch::of<at::Tensor>({torch::ones({2, 2}), torch::tensor(7)})};
  std::vector<char> buf;
  caf::binary_serializer sink{sys, buf};
  ASSERT_FALSE(sink(w));
  troupe::work_chunk back;
  caf::binary_deserializer source{sys, buf};
  ASSERT_FALSE(source(back));
  auto* items = back.items.as<at::Tensor>();
  ASSERT_NE(items, nullptr);
  ASSERT_EQ(items->items.size(), 2u);
  expect_same(items->items[0], torch::ones({2, 2}));
  expect_same(items->items[1], torch::tensor(7));
}

namespace {
struct double_it {
  struct producer {
    explicit producer(const troupe::device& d) : where(d) {}
    at::Tensor work(const at::Tensor& x) { return troupe::to_device(x, where) * 2; }
    troupe::device where;
  };
  struct consumer {
    void work(at::Tensor y) { sum += troupe::to_host(y).sum().item<double>(); }
    double end() { return sum; }
    double sum = 0;
  };
};
}  // namespace

TEST(Tensor, TensorPayloadsThroughARunner) {
  troupe::ordered_runner<double_it> runner{troupe::cpus(2)};
  std::vector<at::Tensor> in;
  for (int i = 0; i < 50; ++i) in.push_back(torch::full({3}, static_cast<float>(i)));
  EXPECT_DOUBLE_EQ(runner.run(in), 2.0 * 3 * (49 * 50 / 2));
}

TEST(Gpu, ProducersRunOnEveryGpu) {
  auto gpus = troupe::gpus();
  if (gpus.empty()) GTEST_SKIP() << "no usable GPU here (no device or no driver)";
  troupe::unordered_runner<double_it> runner{gpus};
  std::vector<at::Tensor> in(20, torch::ones({1000}));
  EXPECT_DOUBLE_EQ(runner.run(in), 20.0 * 2000);
}

TEST(Gpu, LinkingTheTorchComponentInstallsCudaSupport) {
  // torch.cpp's static initializer ran (the --undefined anchor kept it in this program); with
  // a LibTorch without CUDA nothing is installed and CUDA devices stay unavailable.
#ifdef TROUPE_TEST_TORCH_HAS_CUDA
  EXPECT_GE(troupe::detail::cuda_device_count(), 0);
#else
  GTEST_SKIP() << "troupe::torch was built without CUDA (a CPU LibTorch or no CUDA toolkit)";
#endif
}

TEST(Gpu, CudaWithoutGpuIsDeviceUnavailable) {
  if (!troupe::gpus().empty()) GTEST_SKIP() << "this machine has a GPU";
  EXPECT_THROW(troupe::unordered_runner<double_it>(std::vector<troupe::device>{"cuda:0"}),
               troupe::device_unavailable);
  EXPECT_EQ(troupe::torch_device("cuda:1"), c10::Device(c10::kCUDA, 1));
}

TEST(Tensor, TruncatedOrLyingMessagesFailToLoad) {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  std::vector<char> buf;
  caf::binary_serializer sink{sys, buf};
  at::Tensor t = torch::ones({256, 256});
  ASSERT_FALSE(sink(t));
  for (std::size_t cut : {buf.size() - 1, buf.size() / 2, std::size_t{3}}) {
    std::vector<char> part(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(cut));
    caf::binary_deserializer source{sys, part};
    at::Tensor back;
    EXPECT_TRUE(source(back)) << "loaded a tensor from " << cut << " of " << buf.size() << " bytes";
  }
  // A header announcing 1 TiB of float data that is not there: refused before allocating.
  std::vector<char> lie;
  caf::binary_serializer liar{sys, lie};
  std::int8_t dtype = static_cast<std::int8_t>(at::kFloat);
  std::vector<std::int64_t> shape{1LL << 38};
  std::uint64_t nbytes = std::uint64_t{1} << 40;
  ASSERT_FALSE(liar(dtype, shape, nbytes));
  caf::binary_deserializer source{sys, lie};
  at::Tensor back;
  EXPECT_TRUE(source(back));
}

// -- custom types holding tensors (docs/api.md, "Custom types across the network") ----------------

namespace {

struct record {
  std::string name;
  at::Tensor values;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, record& x) {
  return f(caf::meta::type_name("test.record"), x.name, x.values);
}

/// The same struct whose inspect() forgets the tensor.
struct record_without_values {
  std::string name;
  at::Tensor values;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, record_without_values& x) {
  return f(caf::meta::type_name("test.record_without_values"), x.name);
}

template <class Record>
struct record_sums {
  struct producer {
    double work(const Record& r) {
      return r.values.defined() ? r.values.sum().template item<double>() : -1;
    }
  };
  struct consumer {
    void work(double y) { sum += y; }
    double end() { return sum; }
    double sum = 0;
  };
};

template <class Record>
std::vector<Record> records(int n) {
  std::vector<Record> rs;
  for (int i = 0; i < n; ++i)
    rs.push_back(Record{"r" + std::to_string(i), torch::arange(static_cast<double>(i % 4 + 1))});
  return rs;
}

}  // namespace

TEST(Tensor, AStructHoldingATensorAndAStringRoundTrips) {
  record r{"seven", torch::arange(7.0)};
  auto copy = troupe::testing::round_trip(r);
  EXPECT_EQ(copy.name, "seven");
  expect_same(copy.values, r.values);
  // A forgotten tensor arrives undefined, as it would on a node.
  record_without_values broken{"seven", torch::arange(7.0)};
  auto lost = troupe::testing::round_trip(broken);
  EXPECT_EQ(lost.name, "seven");
  EXPECT_FALSE(lost.values.defined());
}

TEST(Tensor, TheSerializeOptionCarriesTensorsInsideStructs) {
  troupe::options opts;
  opts.serialize = true;
  // Sums: 0, 1, 3, 6 repeating: 10 per 4 records.
  troupe::ordered_runner<record_sums<record>> ok{2, {}, opts};
  EXPECT_DOUBLE_EQ(ok.run(records<record>(40)), 100.0);
  // Without the tensor in inspect(), every record arrives without values: -1 each.
  troupe::ordered_runner<record_sums<record_without_values>> broken{2, {}, opts};
  EXPECT_DOUBLE_EQ(broken.run(records<record_without_values>(40)), -40.0);
}

namespace {

/// The ids of this process's threads now.
std::set<std::string> task_ids() {
  std::set<std::string> ids;
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (auto* e = ::readdir(d))
      if (e->d_name[0] != '.') ids.insert(e->d_name);
    ::closedir(d);
  }
  return ids;
}

/// A forward pass that LibTorch parallelizes (a matmul through MKL, an element-wise op through
/// ATen's parallel_for): answers the intra-op threads its producer's thread has.
struct forward_pass {
  struct producer {
    std::int64_t work(std::int64_t seed) {
      torch::NoGradGuard no_grad;
      auto a = torch::full({256, 256}, static_cast<float>(seed % 7) + 1.0f);
      auto y = torch::exp(torch::matmul(a, a) * 1e-6f);
      for (int i = 0; i < 4; ++i) y = torch::exp(torch::matmul(y, a) * 1e-6f);
      auto big = torch::ones({1 << 20});
      (void)torch::exp(big).sum().item<float>();
      return at::get_num_threads();
    }
  };
  struct consumer {
    void work(std::int64_t n) { seen.push_back(n); }
    std::vector<std::int64_t> end() { return seen; }
    std::vector<std::int64_t> seen;
  };
};

/// Runs forward passes on `producers` CPU producers with `cfg`; returns the intra-op threads
/// each reported and how many threads of the process the forward passes started.
std::pair<std::vector<std::int64_t>, std::size_t> forward_passes(std::size_t producers,
                                                                 troupe::config cfg) {
  troupe::options o;
  o.speculative = false;
  troupe::unordered_runner<forward_pass> r{troupe::cpus(producers), cfg, o};
  auto before = task_ids();  // the producers' threads exist; their OpenMP teams do not yet
  auto seen = r.run(std::vector<std::int64_t>(64, 3));
  std::size_t started = 0;  // OpenMP workers live as long as their producer: still there
  for (auto& id : task_ids()) started += before.count(id) == 0 ? 1 : 0;
  return {seen, started};
}

}  // namespace

TEST(ThreadBudgets, EachCpuProducerRunsLibTorchOnItsOwnBudgetOfIntraOpThreads) {
  // Per producer thread, not process-wide (at::set_num_threads would be): counted by the
  // threads a forward pass starts (an OpenMP team of n threads is its caller plus n - 1
  // workers, kept while the caller lives) and by what LibTorch reports on that thread.
  troupe::config one, two;
  one.set("torch.intra_op_threads", 1);
  two.set("torch.intra_op_threads", 2);
  auto [seen1, started1] = forward_passes(2, one);
  for (auto n : seen1) EXPECT_EQ(n, 1);
  EXPECT_EQ(started1, 0u) << "a budget of 1 started intra-op threads";
  auto [seen2, started2] = forward_passes(2, two);
  for (auto n : seen2) EXPECT_EQ(n, 2);
  EXPECT_EQ(started2, 2u) << "2 producers with 2 threads each: one worker each";
  // By default the cores are divided among the process's CPU producers (at least 1 each).
  auto cores = static_cast<std::int64_t>(troupe::detail::usable_cores());
  auto [seen3, started3] = forward_passes(2, {});
  auto share = std::max<std::int64_t>(1, cores / 2);
  for (auto n : seen3) EXPECT_EQ(n, share);
  EXPECT_EQ(started3, static_cast<std::size_t>(2 * (share - 1)));
  std::cout << cores << " cores, 2 CPU producers: " << share << " intra-op thread(s) each\n";
  // An operator's OMP_NUM_THREADS caps the default share (it was exceeded silently);
  // torch.intra_op_threads is still taken as given.
  ::setenv("OMP_NUM_THREADS", "1", 1);
  auto [seen4, started4] = forward_passes(1, {});
  auto [seen5, started5] = forward_passes(1, two);
  ::unsetenv("OMP_NUM_THREADS");
  for (auto n : seen4) EXPECT_EQ(n, 1) << "OMP_NUM_THREADS=1 exceeded";
  EXPECT_EQ(started4, 0u);
  for (auto n : seen5) EXPECT_EQ(n, 2);
}
