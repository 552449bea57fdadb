// Remote benchmarks over loopback, side by side in one run:
//   trivial items per second through two nodes (child processes of this program) vs local;
//   64 MiB tensors through a node and back vs a plain TCP echo of the same bytes.
// Usage: troupe_remote_bench [--count N] [--tensors K] [--huge-mib M] [--tls-cert F --tls-key F
//        --tls-ca F]      (children: --serve ... --devices ...)
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <numeric>
#include <thread>
#include <troupe/torch.hpp>
#include <vector>

#include "bench_jobs.hpp"
#include "child_node.hpp"
#include "common/cli.hpp"

TROUPE_REGISTER_JOB(squares);

struct echo_tensor {
  struct producer {
    at::Tensor work(const at::Tensor& t) { return t; }
  };
  struct consumer {
    void work(const at::Tensor& t) {
      // Spot-check the contents (every 4096th value): tensor i is filled with i + 1.
      auto first = t[0].item<float>();
      if (first < 1 || !t.slice(0, 0, t.size(0), 4096).eq(first).all().item<bool>())
        throw std::runtime_error("a tensor came back with other contents");
      bytes += t.nbytes();
    }
    std::size_t end() { return bytes; }
    std::size_t bytes = 0;
  };
};
TROUPE_REGISTER_JOB(echo_tensor);

namespace {

using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// Best of 3: items from a generator (one at a time), or from a vector in memory (lent to
/// local producers, copied block by block for nodes).
template <class Runner>
double items_per_second(Runner& runner, std::int64_t n, bool from_vector) {
  double best = 1e9;
  std::vector<std::int64_t> xs;
  if (from_vector) {
    xs.resize(static_cast<std::size_t>(n));
    std::iota(xs.begin(), xs.end(), std::int64_t{0});
  }
  for (int r = 0; r < 3; ++r) {
    std::int64_t i = 0;
    auto t0 = clock_type::now();
    std::int64_t sum = 0;
    if (from_vector)
      sum = runner.run(xs);
    else
      sum = runner.run(troupe::generate([&]() -> std::optional<std::int64_t> {
        if (i == n) return std::nullopt;
        return i++;
      }));
    best = std::min(best, since(t0));
    if (sum == 0 && n > 1) throw std::runtime_error("wrong sum");
  }
  return n / best;
}

/// Sends `bytes` to an echo thread over loopback TCP and reads them back, `rounds` times.
double tcp_echo_seconds(std::size_t bytes, int rounds) {
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  listen(listener, 1);
  std::thread echo{[&] {
    int fd = accept(listener, nullptr, nullptr);
    std::vector<char> buf(1 << 20);
    for (;;) {
      auto n = read(fd, buf.data(), buf.size());
      if (n <= 0) break;
      for (ssize_t done = 0; done < n;) done += write(fd, buf.data() + done, n - done);
    }
    close(fd);
  }};
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  std::vector<char> data(bytes, 1), back(bytes);
  auto t0 = clock_type::now();
  for (int r = 0; r < rounds; ++r) {
    std::thread writer{[&] {
      for (std::size_t done = 0; done < bytes;) done += write(fd, data.data() + done, bytes - done);
    }};
    for (std::size_t done = 0; done < bytes;) done += read(fd, back.data() + done, bytes - done);
    writer.join();
  }
  double s = since(t0);
  shutdown(fd, SHUT_WR);
  echo.join();
  close(fd);
  close(listener);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe remote benchmarks over loopback"};
  example::flags f;
  int tensors = 8;
  std::int64_t items = 2'000'000;
  example::add_flags(app, f);
  app.add_option("--tensors", tensors,
                 "64 MiB tensors sent through a node and back (the TCP echo of as many is the "
                 "trivial items' yardstick too)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--count", items, "trivial items");
  bool from_vector = false;
  app.add_flag("--vector", from_vector, "trivial items from a vector in memory (else a generator)");
  std::size_t max_chunk_items = troupe::options{}.max_chunk_items;
  app.add_option("--max-chunk-items", max_chunk_items, "options::max_chunk_items of the runners");
  std::int64_t huge_mib = 0;
  app.add_option("--huge-mib", huge_mib,
                 "also send one tensor of this many MiB through a node and back (4200: more "
                 "than one CAF message can carry; needs about 3x that in memory)");
  CLI11_PARSE(app, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;  // --serve: a node

  std::vector<std::string> tls_args;  // the coordinator's identity: enough for a benchmark
  if (!f.tls_cert.empty())
    tls_args = {"--tls-cert", f.tls_cert, "--tls-key", f.tls_key, "--tls-ca", f.tls_ca};
  child_node a{argv[0], "cpu", tls_args}, b{argv[0], "cpu", tls_args};
  troupe::options opts;
  opts.max_chunk_items = max_chunk_items;
  troupe::unordered_runner<squares> local{2, {}, opts};
  double local_rate = items_per_second(local, items, from_vector);
  auto c = troupe::cluster::connect({a.address, b.address}, f.tls());
  troupe::unordered_runner<squares> remote{c.devices(), {}, opts};
  double remote_rate = items_per_second(remote, items, from_vector);
  std::cout << "trivial items (" << items << " x*x, 2 producers, from a "
            << (from_vector ? "vector" : "generator") << ", max_chunk_items " << max_chunk_items
            << "):\n"
            << "  local producers           : " << local_rate / 1e6 << " M items/s\n"
            << "  2 nodes over loopback     : " << remote_rate / 1e6 << " M items/s ("
            << 100 * remote_rate / local_rate << " % of local)\n";

  const std::size_t bytes = std::size_t{64} << 20;
  troupe::unordered_runner<echo_tensor> echo{std::vector<troupe::device>{c.devices()[0]}};
  std::vector<at::Tensor> inputs;
  for (int i = 0; i < tensors; ++i)
    inputs.push_back(
        torch::full({static_cast<std::int64_t>(bytes / 4)}, static_cast<float>(i + 1)));
  echo.run(std::vector<at::Tensor>{inputs[0]});  // warm up the connection
  auto t0 = clock_type::now();
  auto echoed = echo.run(inputs);
  double troupe_s = since(t0);
  if (echoed != bytes * inputs.size()) return 1;
  double tcp_s = tcp_echo_seconds(bytes, tensors);
  double troupe_bw = 2.0 * bytes * tensors / troupe_s / 1e6,
         tcp_bw = 2.0 * bytes * tensors / tcp_s / 1e6;
  std::cout << "64 MiB tensors through a node and back (" << tensors << " round trips):\n"
            << "  troupe                    : " << troupe_bw << " MB/s\n"
            << "  plain TCP echo            : " << tcp_bw << " MB/s\n"
            << "  troupe / TCP              : " << 100 * troupe_bw / tcp_bw << " %\n";
  // Issue 24's yardstick: the trivial items as bytes (an 8-byte number there and an 8-byte
  // square back: 16 bytes per item) against the echo's bytes per second in this same run.
  double trivial_bw = 16.0 * remote_rate / 1e6;
  std::cout << "trivial items through 2 nodes as bytes (16 per item, both ways): " << trivial_bw
            << " MB/s, " << 100 * trivial_bw / tcp_bw << " % of the TCP echo (target >= 60 %)\n";

  if (huge_mib > 0) {
    auto n = huge_mib * (std::int64_t{1} << 20) / 4;
    std::vector<at::Tensor> one{torch::ones({n})};
    auto t1 = clock_type::now();
    auto back = echo.run(one);
    double s = since(t1);
    if (back != static_cast<std::size_t>(n) * 4) return 1;
    std::cout << "one " << huge_mib << " MiB tensor through a node and back: " << s << " s ("
              << 2.0 * static_cast<double>(back) / s / 1e6 << " MB/s)\n";
  }
}
