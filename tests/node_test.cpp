// Several machines on loopback (API.md §6): real node processes, killed and frozen mid-run.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <thread>
#include <troupe/bulk.hpp>

#include "remote_jobs.hpp"

TROUPE_REGISTER_JOB(remote_squares);
TROUPE_REGISTER_JOB(remote_blobs);
#ifdef TROUPE_WITH_TORCH
TROUPE_REGISTER_JOB(remote_tensors);
#endif

namespace {

/// A job this program registers and the test nodes do not.
struct only_here {
  struct producer {
    std::int64_t work(std::int64_t x) { return x; }
  };
};
TROUPE_REGISTER_JOB(only_here);

/// The test nodes register a "mismatched" job of other types (int64 -> int64).
struct string_mismatched {
  struct producer {
    std::int64_t work(const std::string& s) { return static_cast<std::int64_t>(s.size()); }
  };
};
[[maybe_unused]] const bool mismatched_registered =
    troupe::register_job_type<string_mismatched>("mismatched");

/// One troupe_test_node process, ended (SIGKILL) by the destructor.
class node_process {
 public:
  explicit node_process(const std::string& devices, std::vector<std::string> extra = {}) {
    int out[2];
    if (pipe(out) != 0) throw std::runtime_error("pipe");
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      std::vector<std::string> args{TROUPE_TEST_NODE, "--serve", "127.0.0.1:0", "--devices",
                                    devices};
      args.insert(args.end(), extra.begin(), extra.end());
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    FILE* in = fdopen(out[0], "r");
    char line[256] = {0};
    // "serving on 127.0.0.1:PORT" (ctest's timeout bounds this read)
    if (fgets(line, sizeof line, in) == nullptr) throw std::runtime_error("node did not start");
    std::string text = line;
    address_ = text.substr(text.find("127.0.0.1"));
    address_.erase(address_.find_last_not_of("\r\n") + 1);
    out_ = in;
  }
  ~node_process() {
    kill(SIGCONT);
    kill(SIGKILL);
    waitpid(pid_, nullptr, 0);
    if (out_) fclose(out_);
  }
  void kill(int sig) const { ::kill(pid_, sig); }
  const std::string& address() const { return address_; }
  std::uint16_t port() const {
    return static_cast<std::uint16_t>(std::stoi(address_.substr(address_.rfind(':') + 1)));
  }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  std::string address_;
};

std::vector<std::int64_t> iota(std::int64_t n) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

std::int64_t sum_of_squares(std::int64_t n) {
  std::int64_t s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += i * i;
  return s;
}

troupe::config slow(std::int64_t us) {
  troupe::config cfg;
  cfg.set("sleep_us", us);
  return cfg;
}

/// Sends `sig` to `node` once the runner's producers have finished `items` items.
void signal_after(const node_process& node, troupe::options& opts, int sig, std::uint64_t items) {
  auto sent = std::make_shared<std::atomic<bool>>(false);
  opts.on_progress = [&node, sig, items, sent](const troupe::progress& p) {
    if (p.done >= items && !sent->exchange(true)) node.kill(sig);
  };
}

}  // namespace

TEST(Nodes, TwoNodesPlusLocalProducersGiveTheLocalResult) {
  node_process a{"cpu,cpu"}, b{"cpu"};
  auto c = troupe::cluster::connect({a.address(), b.address()});
  ASSERT_EQ(c.devices().size(), 3u);
  EXPECT_EQ(c.devices()[0], troupe::device{a.address() + "/cpu"});
  auto devices = c.devices();
  devices.push_back("cpu");
  troupe::ordered_runner<remote_squares> runner{devices};
  EXPECT_EQ(runner.run(iota(5000)), sum_of_squares(5000));
  EXPECT_EQ(runner.run(iota(10)), sum_of_squares(10));  // several runs
  auto s = runner.stats();
  std::uint64_t remote_items = 0;
  for (std::size_t i = 0; i < 3; ++i) remote_items += s.producers[i].items;
  EXPECT_GT(remote_items, 0u);  // the nodes did take work
}

TEST(Nodes, LargeItemsAreSplitAndJoinedBothWays) {
  node_process a{"cpu"};
  auto c = troupe::cluster::connect({a.address()});
  std::vector<std::vector<std::int64_t>> items{{}, {7}};
  for (std::int64_t k = 0; k < 5; ++k) {  // 3.1 to 4.7 MB each, odd sizes
    std::vector<std::int64_t> v(static_cast<std::size_t>(393'223 + 50'000 * k));
    std::iota(v.begin(), v.end(), k * 1'000'000);
    items.push_back(std::move(v));
  }
  auto before = troupe::bulk::totals();
  troupe::ordered_runner<remote_blobs> runner{c.devices()};
  auto out = runner.run(items);
  ASSERT_EQ(out.size(), items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    auto want = items[i];
    for (auto& x : want) x = 3 * x + 1;
    EXPECT_EQ(out[i], want) << "item " << i;
  }
  auto after = troupe::bulk::totals();
  EXPECT_GT(after.sent, before.sent);      // chunks went out as fragments
  EXPECT_GT(after.joined, before.joined);  // and outputs came back as fragments
  EXPECT_EQ(troupe::bulk::pending_streams(), 0u);
}

#ifdef TROUPE_WITH_TORCH
TEST(Nodes, TensorsCrossAsRawBytesExactly) {
  node_process a{"cpu"};
  auto c = troupe::cluster::connect({a.address()});
  std::vector<at::Tensor> inputs{
      at::arange(0, (3 << 18) + 7, at::kFloat),                            // 3 MiB, odd size
      at::arange(0, 512 * 1024, at::kDouble).reshape({512, 1024}),         // 4 MiB, 2-d
      at::arange(0, (1 << 20) + 3, at::kInt).to(at::kChar),                // 1 MiB + 3, int8
      at::arange(0, 6, at::kLong).reshape({2, 3}).t(),                     // small, not contiguous
      at::empty({0, 4}, at::kFloat),                                       // empty
      at::randn({(1 << 22) + 1}, at::kFloat).slice(0, 1, (1 << 22) + 1)};  // 16 MiB, offset view
  auto before = troupe::bulk::totals();
  troupe::ordered_runner<remote_tensors> runner{c.devices()};
  auto out = runner.run(inputs);
  ASSERT_EQ(out.size(), inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_EQ(out[i].scalar_type(), inputs[i].scalar_type()) << "tensor " << i;
    EXPECT_EQ(out[i].sizes(), inputs[i].sizes()) << "tensor " << i;
    EXPECT_TRUE(at::equal(out[i], inputs[i] * 2)) << "tensor " << i;
    if (out[i].nbytes() >= troupe::bulk::block_min) {  // joined in place, at an aligned offset
      auto address = reinterpret_cast<std::uintptr_t>(out[i].data_ptr());
      EXPECT_EQ(address % troupe::bulk::alignment, 0u) << "tensor " << i;
    }
  }
  EXPECT_GT(troupe::bulk::totals().joined, before.joined);
  EXPECT_EQ(troupe::bulk::pending_streams(), 0u);
}
#endif

TEST(Nodes, SigkillOfOneNodeMidRunStillGivesTheExactResult) {
  node_process a{"cpu,cpu"}, b{"cpu,cpu"};
  auto c = troupe::cluster::connect({a.address(), b.address()});
  troupe::options opts;
  signal_after(a, opts, SIGKILL, 200);
  troupe::unordered_runner<remote_squares> runner{c.devices(), slow(2000), opts};
  EXPECT_EQ(runner.run(iota(1000)), sum_of_squares(1000));
  auto s = runner.stats();
  EXPECT_FALSE(s.producers[0].alive);
  EXPECT_TRUE(s.producers[2].alive);
}

TEST(Nodes, SigstopOfOneNodeMidRunGivesTheExactResult) {
  node_process a{"cpu,cpu"}, b{"cpu,cpu"};
  auto c = troupe::cluster::connect({a.address(), b.address()});
  troupe::options opts;
  signal_after(a, opts, SIGSTOP, 200);
  troupe::ordered_runner<remote_squares> runner{c.devices(), slow(2000), opts};
  // Heartbeats give the frozen node up after ~1.5 s; its chunks go to the other node.
  EXPECT_EQ(runner.run(iota(1000)), sum_of_squares(1000));
  // The run may end first (an idle producer takes the frozen node's chunks as speculative
  // copies); the heartbeats give the node up all the same.
  for (int i = 0; i < 400 && runner.stats().producers[0].alive; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_FALSE(runner.stats().producers[0].alive);
}

TEST(Nodes, AProducerHungInsideWorkIsGivenUpOnWithWorkTimeout) {
  node_process a{"cpu,cpu"};
  auto c = troupe::cluster::connect({a.address()});
  troupe::config cfg;
  cfg.set("hang_on", std::int64_t{5});  // one producer on the node never returns from item 5,
  troupe::options opts;                 // while the node itself keeps answering heartbeats
  opts.work_timeout = std::chrono::milliseconds{1000};
  opts.speculative = false;  // else an idle producer may take the stuck chunk first
  troupe::unordered_runner<remote_squares> runner{c.devices(), cfg, opts};
  EXPECT_EQ(runner.run(iota(300)), sum_of_squares(300));  // item 5 retried, exactly once
  auto s = runner.stats();
  EXPECT_NE(s.producers[0].alive, s.producers[1].alive);  // only the stuck one was given up on
  EXPECT_EQ(runner.run(iota(20)), sum_of_squares(20));
}

TEST(Nodes, LosingEveryNodeIsNodeErrorAndANewNodeCanBeUsed) {
  {
    node_process a{"cpu"};
    auto c = troupe::cluster::connect({a.address()});
    troupe::options opts;
    signal_after(a, opts, SIGKILL, 50);
    troupe::unordered_runner<remote_squares> runner{c.devices(), slow(2000), opts};
    try {
      runner.run(iota(1000));
      FAIL() << "expected node_error";
    } catch (const troupe::node_error& e) {
      EXPECT_NE(std::string{e.what()}.find(a.address()), std::string::npos) << e.what();
    }
    EXPECT_THROW(runner.run({1}), troupe::node_error);  // still no producer: no hang
  }
  node_process fresh{"cpu"};  // nothing to restart: a new connect just works
  auto c = troupe::cluster::connect({fresh.address()});
  troupe::unordered_runner<remote_squares> runner{c.devices()};
  EXPECT_EQ(runner.run(iota(100)), sum_of_squares(100));
}

TEST(Nodes, UnreachableNodesAndUnknownJobsAreClearErrors) {
  try {
    troupe::cluster::connect({"127.0.0.1:1"});
    FAIL();
  } catch (const troupe::node_error& e) {
    EXPECT_NE(std::string{e.what()}.find("127.0.0.1:1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(troupe::cluster::connect({"no-port"}), troupe::invalid_argument);
  node_process a{"cpu"};
  try {
    troupe::unordered_runner<only_here> runner{std::vector<troupe::device>{a.address() + "/cpu"}};
    FAIL();
  } catch (const troupe::node_error& e) {
    EXPECT_NE(std::string{e.what()}.find("does not run job 'only_here'"), std::string::npos)
        << e.what();
  }
  try {
    troupe::unordered_runner<string_mismatched> runner{
        std::vector<troupe::device>{a.address() + "/cpu"}};
    FAIL();
  } catch (const troupe::node_error& e) {
    EXPECT_NE(std::string{e.what()}.find("job 'mismatched' here takes"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(troupe::unordered_runner<remote_squares>(
                   std::vector<troupe::device>{a.address() + "/cuda:0"}),
               troupe::device_unavailable);
}

namespace {
void send_raw(std::uint16_t port, const std::string& bytes) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  (void)!write(fd, bytes.data(), bytes.size());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  close(fd);
}
}  // namespace

TEST(Nodes, GarbageOnTheNodePortLeavesItServing) {
  node_process a{"cpu"};
  std::mt19937 rng{42};
  std::string noise(64 * 1024, '\0');
  for (auto& ch : noise) ch = static_cast<char>(rng());
  send_raw(a.port(), noise);
  send_raw(a.port(), std::string(3, '\0'));  // a truncated frame
  // A header-sized frame announcing a 4 GiB payload that never comes.
  std::string huge(40, '\0');
  for (int i = 4; i < 8; ++i) huge[i] = '\xff';
  send_raw(a.port(), huge);
  auto c = troupe::cluster::connect({a.address()});
  troupe::unordered_runner<remote_squares> runner{c.devices()};
  EXPECT_EQ(runner.run(iota(100)), sum_of_squares(100));
}

namespace {

/// Certificates made once per test process by tests/make_test_certs.sh, removed at its exit.
struct temp_cert_dir {
  std::string path;
  temp_cert_dir() {
    char tmpl[] = "/tmp/troupe-certs-XXXXXX";
    path = mkdtemp(tmpl);
    std::string cmd = std::string{TROUPE_MAKE_CERTS} + " " + path;
    if (std::system(cmd.c_str()) != 0) throw std::runtime_error("making test certificates failed");
  }
  ~temp_cert_dir() { std::filesystem::remove_all(path); }
};

const std::string& cert_dir() {
  static const temp_cert_dir dir;
  return dir.path;
}

troupe::tls tls_of(const std::string& who, const std::string& ca = "ca") {
  auto d = cert_dir() + "/";
  return {d + who + ".pem", d + who + ".key", d + ca + ".pem", {}};
}

std::vector<std::string> tls_flags(const troupe::tls& t) {
  return {"--tls-cert", t.cert, "--tls-key", t.key, "--tls-ca", t.ca};
}

}  // namespace

/// Runs the sum_of_squares example as a coordinator of `node` in a child process (a process has
/// one TLS identity) and returns what it printed.
std::string coordinate(const std::string& node, const std::vector<std::string>& flags) {
  std::string cmd = std::string{TROUPE_EXAMPLE} + " --items 10 --nodes " + node;
  for (auto& f : flags) cmd += " " + f;
  cmd += " 2>&1";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  char buf[512];
  while (fgets(buf, sizeof buf, p) != nullptr) out += buf;
  pclose(p);
  return out;
}

// This process's network identity is the client certificate: ctest runs each test in a
// process of its own.
TEST(NodesTls, ServesPeersWithACertificateOfItsCaAndRefusesOthers) {
  node_process a{"cpu,cpu", tls_flags(tls_of("node"))};
  // No certificate at all, or one signed by another CA: refused, with the node named.
  auto plain = coordinate(a.address(), {});
  EXPECT_NE(plain.find("error: cannot use node " + a.address()), std::string::npos) << plain;
  auto intruder = coordinate(a.address(), tls_flags(tls_of("intruder")));
  EXPECT_NE(intruder.find("error: cannot use node " + a.address()), std::string::npos) << intruder;
  // A peer with a certificate of the node's CA is served.
  auto c = troupe::cluster::connect({a.address()}, tls_of("client"));
  troupe::unordered_runner<remote_squares> runner{c.devices()};
  EXPECT_EQ(runner.run(iota(500)), sum_of_squares(500));
  EXPECT_EQ(runner.run(iota(10)), sum_of_squares(10));
  // Large items cross as bulk fragments over TLS too.
  std::vector<std::int64_t> big(600'000);
  std::iota(big.begin(), big.end(), 5);
  auto before = troupe::bulk::totals();
  troupe::ordered_runner<remote_blobs> blobs{c.devices()};
  auto out = blobs.run(std::vector<std::vector<std::int64_t>>{big});
  ASSERT_EQ(out.size(), 1u);
  for (auto& x : big) x = 3 * x + 1;
  EXPECT_EQ(out[0], big);
  EXPECT_GT(troupe::bulk::totals().joined, before.joined);
}

TEST(NodesTls, PeersRefusedDuringARunLeaveItUndisturbed) {
  node_process a{"cpu,cpu", tls_flags(tls_of("node"))};
  auto c = troupe::cluster::connect({a.address()}, tls_of("client"));
  troupe::options opts;
  int refused = 0;
  // In the middle of the run (the scheduler waits inside on_progress, so the run cannot end
  // meanwhile): a plain peer and a foreign-CA peer fail their handshakes with the node.
  opts.on_progress = [&, done = false](const troupe::progress& p) mutable {
    if (done || p.done < 50) return;
    done = true;
    for (auto& flags : {std::vector<std::string>{}, tls_flags(tls_of("intruder"))})
      if (coordinate(a.address(), flags).find("error: cannot use node") != std::string::npos)
        refused += 1;
  };
  troupe::unordered_runner<remote_squares> runner{c.devices(), slow(2000), opts};
  EXPECT_EQ(runner.run(iota(400)), sum_of_squares(400));
  EXPECT_EQ(refused, 2);
  auto s = runner.stats();
  EXPECT_TRUE(s.producers[0].alive && s.producers[1].alive);  // the node was never given up on
  EXPECT_EQ(runner.run(iota(100)), sum_of_squares(100));
}

TEST(NodesTls, BadKeyFilesAreRejectedBeforeAnyConnection) {
  auto t = tls_of("client");
  EXPECT_NO_THROW(troupe::check_tls(t));
  t.key = cert_dir() + "/client-encrypted.key";
  t.passphrase = "secret";
  EXPECT_NO_THROW(troupe::check_tls(t));
  t.passphrase = "wrong";
  try {
    troupe::cluster::connect({"127.0.0.1:1"}, t);
    FAIL();
  } catch (const troupe::invalid_argument& e) {
    EXPECT_NE(std::string{e.what()}.find("client-encrypted.key"), std::string::npos) << e.what();
  }
  t.passphrase = "";  // a protected key and no passphrase: an error, never a prompt
  EXPECT_THROW(troupe::check_tls(t), troupe::invalid_argument);
  t.key = cert_dir() + "/missing.key";
  EXPECT_THROW(troupe::node::serve("127.0.0.1:0", {"cpu"}, t), troupe::invalid_argument);
  t.key = cert_dir() + "/ca.pem";  // not a key
  EXPECT_THROW(troupe::check_tls(t), troupe::invalid_argument);
}
