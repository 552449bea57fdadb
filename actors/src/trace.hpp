// options::trace_file: a runner's scheduler writes Chrome trace events (JSON, one event per
// line) that Perfetto and chrome://tracing load: a lane per producer (pid: the coordinator or
// a node, tid: the producer's slot + 1; tid 0 is the scheduler), an X event per chunk worked,
// flow arrows from dispatch to the chunk, instants for losses, retries, speculative copies and
// producers that join or leave. No CAF header: part of the scheduler's core.
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace troupe::detail {

class trace_writer {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  /// Opens `path` (throws invalid_argument when it cannot); events past `max_bytes` are
  /// dropped and counted (the count is written at the end).
  trace_writer(const std::string& path, std::size_t max_bytes, time_point origin);
  ~trace_writer();
  trace_writer(const trace_writer&) = delete;
  trace_writer& operator=(const trace_writer&) = delete;

  /// Names producer `p`'s lane (once per slot): `node` "" for this process.
  void lane(std::size_t p, const std::string& node, const std::string& device);
  /// The scheduler sent chunk `flow` to producer `p` (a flow arrow starts).
  void dispatch(std::size_t p, std::uint64_t flow, time_point t);
  /// Producer `p` worked on a chunk for `busy` up to about `answered` (when its answer came).
  /// `idle`: how long the producer waited before it (chunk_result::idle_ns), in its args.
  void chunk(std::size_t p, std::uint64_t flow, std::uint64_t job, std::uint64_t first,
             std::size_t items, std::size_t bytes, std::chrono::nanoseconds busy,
             std::chrono::nanoseconds idle, time_point sent, time_point answered, bool ok);
  /// A moment on producer `p`'s lane (or the scheduler's: p == scheduler_lane).
  void instant(std::size_t p, const std::string& name, const std::string& detail, time_point t);
  static constexpr std::size_t scheduler_lane = static_cast<std::size_t>(-1);

  [[nodiscard]] std::uint64_t dropped() const noexcept { return dropped_; }

 private:
  void write(const std::string& event);
  [[nodiscard]] double us(time_point t) const;
  int pid_of(std::size_t p) const;

  std::ofstream out_;
  std::size_t max_bytes_;
  std::size_t written_ = 0;
  std::uint64_t dropped_ = 0;
  bool first_ = true;
  time_point origin_;
  std::map<std::string, int> pids_;           ///< node ("" = this process) -> pid
  std::map<std::size_t, int> pid_of_;         ///< producer slot -> pid
  std::map<std::size_t, double> busy_until_;  ///< lane -> end of its last X event (us)
  double latest_ = 0;
  double dispatch_until_ = 0;  ///< where the scheduler lane's last dispatch slice ends (us) ///<
                               ///< the latest time written (us)
};

}  // namespace troupe::detail
