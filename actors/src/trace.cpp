// Chrome trace events for options::trace_file (trace.hpp).
#include "trace.hpp"

#include <algorithm>
#include <cstdio>

#include "troupe/detail/json.hpp"
#include "troupe/error.hpp"

namespace troupe::detail {

namespace {
/// Room kept for the last lines (the dropped count and the closing brackets).
constexpr std::size_t tail_room = 1024;
}  // namespace

trace_writer::trace_writer(const std::string& path, std::size_t max_bytes, time_point origin)
    : out_(path, std::ios::out | std::ios::trunc),
      max_bytes_(std::max(max_bytes, 4 * tail_room)),
      origin_(origin) {
  if (!out_) throw invalid_argument("options::trace_file: cannot write " + path);
  out_ << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  written_ = 40;
  pids_[""] = 1;
  write(R"({"ph":"M","name":"process_name","pid":1,"tid":0,"args":{"name":"coordinator"}})");
  write(R"({"ph":"M","name":"thread_name","pid":1,"tid":0,"args":{"name":"scheduler"}})");
}

trace_writer::~trace_writer() {
  max_bytes_ += tail_room;  // the end always fits
  write(R"({"ph":"i","s":"g","name":"trace ends","pid":1,"tid":0,"ts":)" + std::to_string(latest_) +
        R"(,"args":{"dropped_events":)" + std::to_string(dropped_) + "}}");
  out_ << "\n],\"otherData\":{\"dropped_events\":" << dropped_ << "}}\n";
}

double trace_writer::us(time_point t) const {
  return std::chrono::duration<double, std::micro>(t - origin_).count();
}

int trace_writer::pid_of(std::size_t p) const {
  if (p == scheduler_lane) return 1;
  auto i = pid_of_.find(p);
  return i == pid_of_.end() ? 1 : i->second;
}

void trace_writer::write(const std::string& event) {
  if (written_ + event.size() + 2 + tail_room > max_bytes_) {
    ++dropped_;
    return;
  }
  if (!first_) out_ << ",\n";
  first_ = false;
  out_ << event;
  written_ += event.size() + 2;
}

void trace_writer::lane(std::size_t p, const std::string& node, const std::string& device) {
  auto it = pids_.find(node);
  if (it == pids_.end()) {
    it = pids_.emplace(node, static_cast<int>(pids_.size()) + 1).first;
    write(R"({"ph":"M","name":"process_name","pid":)" + std::to_string(it->second) +
          R"(,"tid":0,"args":{"name":)" + json_quote("node " + node) + "}}");
  }
  pid_of_[p] = it->second;
  write(R"({"ph":"M","name":"thread_name","pid":)" + std::to_string(it->second) + R"(,"tid":)" +
        std::to_string(p + 1) + R"(,"args":{"name":)" +
        json_quote("producer " + std::to_string(p) + " (" + device + ")") + "}}");
}

void trace_writer::dispatch(std::size_t p, std::uint64_t flow, time_point t) {
  // A 10 ns slice on the scheduler's lane for the arrow to start from, after the previous one
  // (several chunks go out in one event: slices that overlapped were mis-nested by Perfetto).
  auto start = std::max(us(t), dispatch_until_);
  dispatch_until_ = start + 0.01;
  latest_ = std::max(latest_, dispatch_until_);
  auto ts = std::to_string(start);
  write(R"({"ph":"X","name":"dispatch","pid":1,"tid":0,"ts":)" + ts +
        R"(,"dur":0.01,"args":{"producer":)" + std::to_string(p) + "}}");
  write(R"({"ph":"s","name":"chunk","cat":"chunk","id":)" + std::to_string(flow) +
        R"(,"pid":1,"tid":0,"ts":)" + ts + "}");
}

void trace_writer::chunk(std::size_t p, std::uint64_t flow, std::uint64_t job, std::uint64_t first,
                         std::size_t items, std::size_t bytes, std::chrono::nanoseconds busy,
                         std::chrono::nanoseconds idle, time_point sent, time_point answered,
                         bool ok) {
  // The producer worked FIFO and answered at about `answered`: its slice ends there, lasts
  // what it measured, and never overlaps the previous slice on its lane (nor starts before
  // the chunk was sent).
  double end = us(answered);
  double dur = std::max(0.0, std::chrono::duration<double, std::micro>(busy).count());
  double start = std::max({end - dur, us(sent), busy_until_[p]});
  if (start > end) end = start;
  dur = end - start;
  busy_until_[p] = end;
  latest_ = std::max(latest_, end);
  auto pid = std::to_string(pid_of(p));
  auto tid = std::to_string(p + 1);
  write(R"({"ph":"X","name":"job )" + std::to_string(job) + R"(","pid":)" + pid + R"(,"tid":)" +
        tid + R"(,"ts":)" + std::to_string(start) + R"(,"dur":)" + std::to_string(dur) +
        R"(,"args":{"job":)" + std::to_string(job) + R"(,"first":)" + std::to_string(first) +
        R"(,"items":)" + std::to_string(items) + R"(,"bytes":)" + std::to_string(bytes) +
        R"(,"idle_us":)" + std::to_string(std::chrono::duration<double, std::micro>(idle).count()) +
        R"(,"ok":)" + (ok ? "true" : "false") + "}}");
  write(R"({"ph":"f","bp":"e","name":"chunk","cat":"chunk","id":)" + std::to_string(flow) +
        R"(,"pid":)" + pid + R"(,"tid":)" + tid + R"(,"ts":)" + std::to_string(start) + "}");
}

void trace_writer::instant(std::size_t p, const std::string& name, const std::string& detail,
                           time_point t) {
  latest_ = std::max(latest_, us(t));
  auto tid = p == scheduler_lane ? std::string{"0"} : std::to_string(p + 1);
  write(R"({"ph":"i","s":"t","name":)" + json_quote(name) + R"(,"pid":)" +
        std::to_string(pid_of(p)) + R"(,"tid":)" + tid + R"(,"ts":)" + std::to_string(us(t)) +
        R"(,"args":{"detail":)" + json_quote(detail) + "}}");
}

}  // namespace troupe::detail
