// Progress of the examples' runs on stderr (never stdout, which the tests read):
//
//   --progress on, stderr a terminal:   a bar redrawn in place at most 10 times a second
//      42% [######          ] 41984/100000  8.1k items/s  ETA 7.2s  p0 51% p1 49%  1 lost
//   --progress on, stderr not a terminal: a plain line every --progress-every-ms (1000), when
//     something changed:
//     progress: 41984/100000 items (42%), 8.1k items/s, 5.2s, ETA 7.2s, p0 51% p1 49%, 1 lost
//   and after a successful run, from the main thread, one summary line:
//     done: 100000 items in 12.3 s, 8.1k items/s, 2 producers
//   --progress auto (the default): the bar and the summary on a terminal (lines instead of the
//     bar with --verbose, whose log lines would break it); elsewhere lines only once a run has
//     lasted a period, and the summary only after a run that printed a line, so that short
//     runs (the tests') print nothing more.
//   --progress off: nothing, and no on_progress callback at all.
//
// troupe calls on_progress on its scheduler's thread: the callback here only copies the report
// (and the runner's stats(), a copy under a mutex) into the display's state. A thread of the
// display's own draws it, so a slow or blocked stderr never holds up troupe. "N lost" counts
// producers that are out of the pool (alive = false) without having been removed.
#pragma once

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <troupe/troupe.hpp>
#include <utility>
#include <vector>

namespace example {

enum class progress_mode { automatic, on, off };

/// "auto", "on" or "off" (the --progress flag's values).
inline progress_mode parse_progress_mode(const std::string& s) {
  if (s == "on") return progress_mode::on;
  if (s == "off") return progress_mode::off;
  return progress_mode::automatic;
}

/// Who did the work so far: items (or shards) per producer slot, and how many were lost.
struct producer_shares {
  std::vector<std::pair<std::size_t, std::uint64_t>> items;  ///< (slot, items), not removed
  std::size_t lost = 0;                                      ///< alive == false, not removed
};

inline producer_shares shares_of(const troupe::stats& s) {
  producer_shares out;
  for (const auto& p : s.producers) {
    if (p.removed) continue;
    out.items.emplace_back(p.index, p.items);
    if (!p.alive) ++out.lost;
  }
  return out;
}

class progress_display {
 public:
  /// `unit` names what is counted ("items", "steps"); `workers` what the summary counts.
  explicit progress_display(progress_mode mode,
                            std::chrono::milliseconds every = std::chrono::milliseconds{1000},
                            bool verbose = false, std::string unit = "items",
                            std::string workers = "producers")
      : mode_(mode),
        every_(std::max(every, std::chrono::milliseconds{10})),
        unit_(std::move(unit)),
        workers_(std::move(workers)) {
    if (mode_ == progress_mode::off) return;
    bar_ = ::isatty(2) == 1 && !(mode_ == progress_mode::automatic && verbose);
    thread_ = std::thread{[this] { loop(); }};
  }
  progress_display(const progress_display&) = delete;
  progress_display& operator=(const progress_display&) = delete;
  ~progress_display() { stop(); }

  /// For options::on_progress or job_options::on_progress; empty with --progress off. Copies
  /// the report (and the watched runner's stats) and returns: it never writes or waits.
  std::function<void(const troupe::progress&)> callback() {
    if (mode_ == progress_mode::off) return {};
    return [this](const troupe::progress& p) {
      std::lock_guard<std::mutex> guard{mtx_};
      take(p);
      if (stats_) shares_ = shares_of(stats_());
    };
  }

  /// The runner whose stats() give the per-producer shares (read inside the callback, on
  /// troupe's thread, as docs/api.md allows). Keep the guard alive no longer than the runner.
  class watch_guard {
   public:
    explicit watch_guard(progress_display* d) : d_(d) {}
    watch_guard(const watch_guard&) = delete;
    watch_guard& operator=(const watch_guard&) = delete;
    ~watch_guard() {
      std::lock_guard<std::mutex> guard{d_->mtx_};
      d_->stats_ = nullptr;
    }

   private:
    progress_display* d_;
  };
  template <class Runner>
  [[nodiscard]] watch_guard watch(const Runner& runner) {
    std::lock_guard<std::mutex> guard{mtx_};
    stats_ = [&runner] { return runner.stats(); };
    shares_ = shares_of(runner.stats());
    return watch_guard{this};
  }

  /// The total to show when the reports have none (a generator whose length the caller knows).
  void expect(std::uint64_t total) {
    std::lock_guard<std::mutex> guard{mtx_};
    expected_ = total;
  }

  /// False with --progress off: nothing is shown, and update() need not be fed.
  [[nodiscard]] bool enabled() const { return mode_ != progress_mode::off; }

  /// For loops that report themselves, on the caller's thread (the train example's steps).
  void update(const troupe::progress& p, producer_shares shares) {
    if (mode_ == progress_mode::off) return;
    std::lock_guard<std::mutex> guard{mtx_};
    take(p);
    shares_ = std::move(shares);
  }

  /// Runs `print` (which writes to stdout and flushes it) with the bar taken off the line, so
  /// that the program's own lines do not land after the bar; it is drawn again afterwards.
  template <class F>
  void print_above(F&& print) {
    std::lock_guard<std::mutex> out{out_mtx_};
    if (drawn_) {
      write_all("\r\033[K");
      drawn_ = false;
      std::lock_guard<std::mutex> guard{mtx_};
      drawn_seq_ = 0;  // draw it again at the next tick
    }
    print();
  }

  /// From the main thread once run() has returned: stops drawing for good, takes the bar off
  /// the line and prints the summary line (with auto on no terminal: only if a line was
  /// printed). Without it (run() threw), the destructor only takes the bar off the line.
  void finish() {
    stop();
    if (mode_ == progress_mode::off) return;
    if (mode_ == progress_mode::automatic && !bar_ && lines_ == 0) return;
    state s;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (seq_ == 0) return;
      s = snapshot();
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, s.p.elapsed_seconds < 1 ? "%.3f" : "%.2f", s.p.elapsed_seconds);
    std::string line = "done: " + std::to_string(s.p.done) + " " + unit_ + " in " + buf + " s, " +
                       rate(s.p.items_per_second) + ", " + std::to_string(s.shares.items.size()) +
                       " " + workers_;
    if (s.shares.lost > 0) line += ", " + std::to_string(s.shares.lost) + " lost";
    // On a terminal the bar stays on its line at its final state (100 % for a finished job).
    if (bar_) line = fit(bar_text(s)) + "\n" + line;
    write_all(line + "\n");
  }

 private:
  struct state {
    troupe::progress p;
    producer_shares shares;
  };

  // Under mtx_. No notify: the display's thread looks at its next tick.
  void take(const troupe::progress& p) {
    last_ = p;
    ++seq_;
  }
  state snapshot() const {
    state s{last_, shares_};
    if (!s.p.total && expected_) s.p.total = expected_;
    return s;
  }

  void stop() {
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (stopped_) return;
      stopped_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> out{out_mtx_};
    if (drawn_) write_all("\r\033[K");
    drawn_ = false;
  }

  void loop() {
    using clock = std::chrono::steady_clock;
    // The bar: at most 10 draws a second; lines: checked as often, printed once a period.
    const auto tick =
        bar_ ? std::chrono::milliseconds{100} : std::min(every_, std::chrono::milliseconds{100});
    auto last_line = clock::now();
    std::unique_lock<std::mutex> lock{mtx_};
    for (;;) {
      cv_.wait_for(lock, tick, [this] { return stopped_; });
      if (stopped_) return;
      if (seq_ == drawn_seq_) continue;  // nothing new
      auto now = clock::now();
      if (!bar_) {
        if (now - last_line < every_) continue;
        // auto: only runs that have lasted a period print lines.
        if (mode_ == progress_mode::automatic &&
            last_.elapsed_seconds * 1000 < static_cast<double>(every_.count()))
          continue;
      }
      drawn_seq_ = seq_;
      auto s = snapshot();
      lock.unlock();
      {
        std::lock_guard<std::mutex> out{out_mtx_};
        if (bar_) {
          write_all("\r\033[K" + fit(bar_text(s)));
          drawn_ = true;
        } else {
          write_all(line_text(s) + "\n");
          ++lines_;
          last_line = now;
        }
      }
      lock.lock();
    }
  }

  static std::string number(double x) {
    char buf[32];
    if (x >= 1e9)
      std::snprintf(buf, sizeof buf, "%.1fG", x / 1e9);
    else if (x >= 1e6)
      std::snprintf(buf, sizeof buf, "%.1fM", x / 1e6);
    else if (x >= 1e4)
      std::snprintf(buf, sizeof buf, "%.1fk", x / 1e3);
    else if (x >= 100)
      std::snprintf(buf, sizeof buf, "%.0f", x);
    else
      std::snprintf(buf, sizeof buf, "%.1f", x);
    return buf;
  }
  std::string rate(double per_second) const { return number(per_second) + " " + unit_ + "/s"; }
  static std::string duration(double seconds) {
    char buf[32];
    auto s = static_cast<long long>(seconds + 0.5);
    if (seconds < 10)
      std::snprintf(buf, sizeof buf, "%.1fs", seconds);
    else if (s < 60)
      std::snprintf(buf, sizeof buf, "%llds", s);
    else if (s < 3600)
      std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
    else
      std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, s / 60 % 60);
    return buf;
  }
  static std::optional<double> eta(const troupe::progress& p) {
    if (!p.total || p.items_per_second <= 0 || p.done >= *p.total) return std::nullopt;
    return static_cast<double>(*p.total - p.done) / p.items_per_second;
  }
  /// "p0 51% p1 49%": each producer's share of the items so far (8 at most, then "+N").
  static std::string shares_text(const producer_shares& s) {
    std::uint64_t sum = 0;
    for (auto& [slot, items] : s.items) sum += items;
    if (sum == 0) return {};
    std::string out;
    std::size_t shown = 0;
    for (auto& [slot, items] : s.items) {
      if (shown == 8) {
        out += " +" + std::to_string(s.items.size() - shown);
        break;
      }
      if (!out.empty()) out += ' ';
      out += "p" + std::to_string(slot) + " " + std::to_string((items * 100 + sum / 2) / sum) + "%";
      ++shown;
    }
    return out;
  }
  static int percent(const troupe::progress& p) {
    if (!p.total || *p.total == 0) return 0;
    return static_cast<int>(std::min<std::uint64_t>(100, p.done * 100 / *p.total));
  }

  std::string bar_text(const state& s) const {
    const auto& p = s.p;
    std::string out;
    if (p.total) {
      constexpr int width = 16;
      int pct = percent(p);
      int filled = pct * width / 100;
      char head[8];
      std::snprintf(head, sizeof head, "%3d%% ", pct);
      out = head + ("[" + std::string(filled, '#') + std::string(width - filled, ' ') + "] ") +
            std::to_string(p.done) + "/" + std::to_string(*p.total);
    } else {
      out = std::to_string(p.done) + " " + unit_;
    }
    out += "  " + rate(p.items_per_second);
    if (auto e = eta(p)) out += "  ETA " + duration(*e);
    auto shares = shares_text(s.shares);
    if (!shares.empty()) out += "  " + shares;
    if (s.shares.lost > 0) out += "  " + std::to_string(s.shares.lost) + " lost";
    return out;
  }

  std::string line_text(const state& s) const {
    const auto& p = s.p;
    std::string out = "progress: " + std::to_string(p.done);
    if (p.total) out += "/" + std::to_string(*p.total);
    out += " " + unit_;
    if (p.total) out += " (" + std::to_string(percent(p)) + "%)";
    out += ", " + rate(p.items_per_second) + ", " + duration(p.elapsed_seconds);
    if (auto e = eta(p)) out += ", ETA " + duration(*e);
    auto shares = shares_text(s.shares);
    if (!shares.empty()) out += ", " + shares;
    if (s.shares.lost > 0) out += ", " + std::to_string(s.shares.lost) + " lost";
    return out;
  }

  /// Cut to the terminal's width, so that the line never wraps (a wrapped bar is not redrawn
  /// in place).
  static std::string fit(std::string s) {
    winsize ws{};
    std::size_t cols = 80;
    if (::ioctl(2, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) cols = ws.ws_col;
    if (s.size() >= cols) s.resize(cols - 1);
    return s;
  }

  static void write_all(const std::string& s) {
    const char* data = s.data();
    std::size_t left = s.size();
    while (left > 0) {
      auto n = ::write(2, data, left);
      if (n <= 0) return;  // stderr closed or broken: progress is not worth an error
      data += n;
      left -= static_cast<std::size_t>(n);
    }
  }

  const progress_mode mode_;
  const std::chrono::milliseconds every_;
  const std::string unit_, workers_;
  bool bar_ = false;
  std::thread thread_;

  std::mutex mtx_;              // the state below, written by the callback and update()
  std::condition_variable cv_;  // stop()
  troupe::progress last_;
  producer_shares shares_;
  std::optional<std::uint64_t> expected_;
  std::function<troupe::stats()> stats_;
  std::uint64_t seq_ = 0, drawn_seq_ = 0;
  bool stopped_ = false;

  std::mutex out_mtx_;  // what is on stderr's line; taken before mtx_ when both are
  bool drawn_ = false;
  std::size_t lines_ = 0;
};

}  // namespace example
