// Troupe over impaired links, side by side in one run (CPU only; no LibTorch needed):
//   one node (child process, 2 CPU producers) reached directly, and an identical node reached
//   through a user-space relay that delays every byte by --delay-ms in each direction (this
//   kernel has no netem); items take --item-ms of producer time. Reports items/s of both, and
//   ordered against unordered on the delayed link.
//   Mixed speeds, locally: an ordered and an unordered runner over one fast (1 ms) and one slow
//   (10 ms) producer, against the ideal (both busy all the time).
// Usage: troupe_link_bench [--delay-ms 20] [--items 2000] [--item-us 1000] [--mixed-items 1100]
//        (children: --serve HOST:PORT --devices LIST)
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <iostream>
#include <list>
#include <mutex>
#include <numeric>
#include <thread>
#include <troupe/troupe.hpp>
#include <vector>

#include "child_node.hpp"
#include "common/cli.hpp"

/// Every item takes config "item_ms" of producer time.
struct timed_squares {
  struct producer {
    producer(const troupe::device&, const troupe::config& cfg)
        : us(cfg.get_or<std::int64_t>("item_us", 1000)) {}
    std::int64_t work(std::int64_t x) {
      std::this_thread::sleep_for(std::chrono::microseconds(us));
      return x * x;
    }
    std::int64_t us;
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};
TROUPE_REGISTER_JOB(timed_squares);

/// 16 KiB items of 1 ms of producer time each: their bytes matter on a slow link.
struct sized_items {
  struct producer {
    std::uint64_t work(const std::vector<char>& bytes) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return bytes.size();
    }
  };
  struct consumer {
    void work(std::uint64_t n) { total += n; }
    std::uint64_t end() { return total; }
    std::uint64_t total = 0;
  };
};
TROUPE_REGISTER_JOB(sized_items);

/// The first producer constructed takes 1 ms per item, the second 10 ms.
struct mixed_speeds {
  static inline std::atomic<int> made{0};
  static inline bool check_order = true;
  struct producer {
    producer() : ms(made++ % 2 == 0 ? 1 : 10) {}
    int work(int x) {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      return x;
    }
    int ms;
  };
  struct consumer {
    void work(int x) {
      if (x != next++ && check_order) throw std::runtime_error("out of order");
    }
    int end() { return next; }
    int next = 0;
  };
};

namespace {

using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// A TCP relay on 127.0.0.1 that holds every byte for `delay` before passing it on, both ways.
class delay_relay {
 public:
  /// `bytes_per_second` > 0 also limits the bandwidth of each direction.
  delay_relay(std::uint16_t target, std::chrono::milliseconds delay, double bytes_per_second = 0)
      : target_(target), delay_(delay), rate_(bytes_per_second) {
    listen_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(listen_, 16) != 0 ||
        getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      throw std::runtime_error("relay: cannot listen");
    port_ = ntohs(a.sin_port);
    threads_.emplace_back([this] { accept_loop(); });
  }
  ~delay_relay() {
    stop_ = true;
    ::shutdown(listen_, SHUT_RDWR);
    {
      std::lock_guard<std::mutex> g{mtx_};
      for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
      for (auto& p : pipes_) {
        std::lock_guard<std::mutex> pg{p.mtx};
        p.eof = true;
        p.cv.notify_all();
      }
    }
    for (auto& t : threads_) t.join();
    for (int fd : fds_) close(fd);
    close(listen_);
  }
  [[nodiscard]] std::uint16_t port() const { return port_; }

 private:
  struct pipe_state {
    std::mutex mtx;
    std::condition_variable cv;
    std::deque<std::pair<clock_type::time_point, std::vector<char>>> queue;
    bool eof = false;
  };

  static void no_delay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }

  void accept_loop() {
    while (!stop_) {
      int client = accept(listen_, nullptr, nullptr);
      if (client < 0) return;
      int server = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(target_);
      if (connect(server, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
        close(client);
        close(server);
        continue;
      }
      no_delay(client);
      no_delay(server);
      std::lock_guard<std::mutex> g{mtx_};
      fds_.push_back(client);
      fds_.push_back(server);
      start_pipe(client, server);
      start_pipe(server, client);
    }
  }

  void start_pipe(int from, int to) {  // with mtx_ held
    auto& p = pipes_.emplace_back();
    threads_.emplace_back([this, from, &p] {
      std::vector<char> buf(1 << 16);
      for (;;) {
        auto n = read(from, buf.data(), buf.size());
        std::lock_guard<std::mutex> g{p.mtx};
        if (n <= 0) {
          p.eof = true;
          p.cv.notify_all();
          return;
        }
        p.queue.emplace_back(clock_type::now() + delay_,
                             std::vector<char>(buf.begin(), buf.begin() + n));
        p.cv.notify_all();
      }
    });
    threads_.emplace_back([this, to, &p] {
      std::unique_lock<std::mutex> g{p.mtx};
      auto free_at = clock_type::now();  // when the limited link can take the next byte
      for (;;) {
        p.cv.wait(g, [&] { return !p.queue.empty() || p.eof; });
        if (p.queue.empty()) break;
        auto due = p.queue.front().first;
        if (clock_type::now() < due) {
          p.cv.wait_until(g, due);
          continue;
        }
        auto bytes = std::move(p.queue.front().second);
        p.queue.pop_front();
        g.unlock();
        if (rate_ > 0) {
          free_at = std::max(free_at, clock_type::now()) +
                    std::chrono::duration_cast<clock_type::duration>(
                        std::chrono::duration<double>(static_cast<double>(bytes.size()) / rate_));
          std::this_thread::sleep_until(free_at);
        }
        std::size_t off = 0;
        while (off < bytes.size()) {
          auto n = send(to, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
          if (n <= 0) return;
          off += static_cast<std::size_t>(n);
        }
        g.lock();
      }
      ::shutdown(to, SHUT_WR);
    });
  }

  std::uint16_t target_;
  std::chrono::milliseconds delay_;
  double rate_ = 0;
  int listen_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::mutex mtx_;
  std::vector<int> fds_;
  std::list<pipe_state> pipes_;
  std::vector<std::thread> threads_;
};

template <class Runner>
double rate(Runner& runner, std::int64_t n) {
  std::vector<std::int64_t> xs(static_cast<std::size_t>(n));
  std::iota(xs.begin(), xs.end(), 0);
  std::int64_t want = 0;
  for (auto x : xs) want += x * x;
  auto t0 = clock_type::now();
  if (runner.run(xs) != want) throw std::runtime_error("wrong result");
  return static_cast<double>(n) / since(t0);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe over impaired links"};
  example::flags f;
  example::add_flags(app, f);
  f.items = 2000;  // --items: items per remote run
  std::int64_t delay_ms = 20, item_us = 1000, mixed_items = 1100;
  app.add_option("--delay-ms", delay_ms, "one-way delay of the relay");
  app.add_option("--item-us", item_us, "producer time per remote item, microseconds");
  app.add_option("--mixed-items", mixed_items, "items per mixed-speed local run (0: skip)");
  CLI11_PARSE(app, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;  // --serve: a node
  auto items = static_cast<std::int64_t>(f.items);

  troupe::config cfg;
  cfg.set("item_us", item_us);
  child_node direct{argv[0], "cpu,cpu"}, far{argv[0], "cpu,cpu"};
  delay_relay relay{far.port, std::chrono::milliseconds{delay_ms}};
  auto relayed = "127.0.0.1:" + std::to_string(relay.port());
  auto near_devices = troupe::cluster::connect({direct.address}).devices();
  auto far_devices = troupe::cluster::connect({relayed}, {}, std::chrono::seconds{10}).devices();
  double near_rate = 0, far_unordered = 0, far_ordered = 0;
  {
    troupe::unordered_runner<timed_squares> runner{near_devices, cfg};
    rate(runner, items / 10);  // warm up: chunk sizes and depths are learned per runner
    near_rate = rate(runner, items);
  }
  {
    troupe::unordered_runner<timed_squares> runner{far_devices, cfg};
    rate(runner, items / 10);
    far_unordered = rate(runner, items);
  }
  {
    troupe::ordered_runner<timed_squares> runner{far_devices, cfg};
    rate(runner, items / 10);
    far_ordered = rate(runner, items);
  }
  double ideal = 2e6 / static_cast<double>(item_us);
  std::printf("one node, 2 CPU producers, %lld items of %lld us (ideal %.0f items/s):\n",
              static_cast<long long>(items), static_cast<long long>(item_us), ideal);
  std::printf("  direct (loopback)                : %8.0f items/s\n", near_rate);
  std::printf("  behind %lld ms each way, unordered: %8.0f items/s = %.0f %% of direct\n",
              static_cast<long long>(delay_ms), far_unordered, 100 * far_unordered / near_rate);
  std::printf("  behind %lld ms each way, ordered  : %8.0f items/s = %.0f %% of unordered\n",
              static_cast<long long>(delay_ms), far_ordered, 100 * far_ordered / far_unordered);

  {
    // A node behind a 10 Mbit/s link next to two local producers: chunks queued at the slow
    // node must not hold up the end of the run (they are also sent to an idle local producer).
    child_node slow{argv[0], "cpu,cpu"};
    delay_relay slow_link{slow.port, std::chrono::milliseconds{1}, 10e6 / 8};
    auto slow_devices =
        troupe::cluster::connect({"127.0.0.1:" + std::to_string(slow_link.port())}).devices();
    std::vector<std::vector<char>> blobs(1000, std::vector<char>(16 * 1024, 1));
    auto timed = [&](std::vector<troupe::device> devices) {
      troupe::unordered_runner<sized_items> runner{devices};
      runner.run(std::vector<std::vector<char>>(blobs.begin(), blobs.begin() + 50));  // learn
      auto t0 = clock_type::now();
      if (runner.run(blobs) != blobs.size() * 16 * 1024) throw std::runtime_error("wrong sum");
      return since(t0);
    };
    auto local_only = timed(troupe::cpus(2));
    auto devices = troupe::cpus(2);
    devices.insert(devices.end(), slow_devices.begin(), slow_devices.end());
    auto with_slow = timed(devices);
    std::printf(
        "1000 items of 16 KiB x 1 ms: 2 local producers %.3f s; the same plus a node "
        "(2 producers) behind 10 Mbit/s %.3f s = %.0f %% of local-only speed\n",
        local_only, with_slow, 100 * local_only / with_slow);
  }

  if (mixed_items > 0) {
    // The ideal from the sleeps' real length here (a 1 ms sleep takes a little longer).
    auto measure = [](int ms, int n) {
      auto t0 = clock_type::now();
      for (int i = 0; i < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      return since(t0) / n;
    };
    double fast = measure(1, 200), slow = measure(10, 20);
    double ideal_s = static_cast<double>(mixed_items) / (1 / fast + 1 / slow);
    for (bool ordered : {true, false}) {
      mixed_speeds::made = 0;
      mixed_speeds::check_order = ordered;
      auto t0 = clock_type::now();
      std::vector<int> xs(static_cast<std::size_t>(mixed_items));
      std::iota(xs.begin(), xs.end(), 0);
      int got = 0;
      if (ordered) {
        troupe::ordered_runner<mixed_speeds> runner{2};
        t0 = clock_type::now();
        got = runner.run(xs);
      } else {
        troupe::unordered_runner<mixed_speeds> runner{2};
        t0 = clock_type::now();
        got = runner.run(xs);
      }
      auto s = since(t0);
      if (got != mixed_items) return 1;
      std::printf(
          "mixed speeds (1 ms and 10 ms producers), %lld items, %s: %.3f s, ideal %.3f s "
          "= %.0f %% of ideal\n",
          static_cast<long long>(mixed_items), ordered ? "ordered  " : "unordered", s, ideal_s,
          100 * ideal_s / s);
    }
  }
}
