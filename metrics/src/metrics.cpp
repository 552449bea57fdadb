// Prometheus metrics of this process (troupe::metrics_text, metrics.hpp): its runners, clusters,
// served nodes, trainers and the process itself, in prometheus-cpp's data model and text
// serializer (Debian's prometheus-cpp-dev). The other parts: status.cpp (/status.json),
// status_page.cpp (the live page), server.cpp (serve_metrics).
#include "troupe/metrics.hpp"

#include <dirent.h>
#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <vector>

#include "troupe/detail/cluster_state.hpp"
#include "troupe/detail/introspect.hpp"
#include "troupe/detail/node_view.hpp"

namespace troupe {

namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using labels = std::vector<ClientMetric::Label>;

MetricFamily family(std::string name, std::string help, MetricType type) {
  MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

void add(MetricFamily& f, labels l, double v) {
  ClientMetric m;
  m.label = std::move(l);
  if (f.type == MetricType::Counter)
    m.counter.value = v;
  else
    m.gauge.value = v;
  f.metric.push_back(std::move(m));
}

/// A family whose samples are read from each of a list of views (one label tells them apart).
template <class View>
struct series {
  const char* name;
  const char* help;
  MetricType type;
  double (*value)(const View&);
};
template <class View, std::size_t N, class LabelOf>
void add_series(std::vector<MetricFamily>& out, const series<View> (&table)[N],
                const std::vector<View>& views, const char* label, LabelOf label_of) {
  for (auto& x : table) {
    auto f = family(x.name, x.help, x.type);
    for (auto& v : views) add(f, {{label, label_of(v)}}, x.value(v));
    out.push_back(std::move(f));
  }
}

void add_histogram(MetricFamily& f, labels l, const detail::seconds_histogram& h) {
  ClientMetric m;
  m.label = std::move(l);
  m.histogram.sample_count = h.count;
  m.histogram.sample_sum = h.sum;
  std::uint64_t cumulative = 0;
  for (std::size_t i = 0; i < h.counts.size(); ++i) {
    cumulative += h.counts[i];
    ClientMetric::Bucket b;
    b.cumulative_count = cumulative;
    b.upper_bound = i < h.bounds.size() ? h.bounds[i] : std::numeric_limits<double>::infinity();
    m.histogram.bucket.push_back(b);
  }
  f.metric.push_back(std::move(m));
}

/// The standard process_* metrics, from /proc (Linux).
void process_metrics(std::vector<MetricFamily>& out) {
  std::ifstream stat_file("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(stat_file)), std::istreambuf_iterator<char>());
  auto after = stat.rfind(')');
  if (after == std::string::npos) return;
  std::istringstream fields(stat.substr(after + 2));
  std::vector<std::string> f((std::istream_iterator<std::string>(fields)),
                             std::istream_iterator<std::string>());
  // Fields from 3 (state) on: utime 14, stime 15, starttime 22, vsize 23, rss 24 (1-based).
  auto at = [&](std::size_t field) { return std::stod(f.at(field - 3)); };
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  double boot = 0;
  {
    std::ifstream s("/proc/stat");
    std::string key;
    while (s >> key)
      if (key == "btime") {
        s >> boot;
        break;
      }
  }
  auto cpu = family("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                    MetricType::Counter);
  add(cpu, {}, (at(14) + at(15)) / ticks);
  auto rss =
      family("process_resident_memory_bytes", "Resident memory size in bytes.", MetricType::Gauge);
  add(rss, {}, at(24) * page);
  auto vsz =
      family("process_virtual_memory_bytes", "Virtual memory size in bytes.", MetricType::Gauge);
  add(vsz, {}, at(23));
  auto start = family("process_start_time_seconds",
                      "Start time of the process since unix epoch in seconds.", MetricType::Gauge);
  add(start, {}, boot + at(22) / ticks);
  std::size_t fds = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (auto* e = readdir(d))
      if (e->d_name[0] != '.') ++fds;
    closedir(d);
    fds -= 1;  // the one opendir itself holds
  }
  auto open_fds = family("process_open_fds", "Number of open file descriptors.", MetricType::Gauge);
  add(open_fds, {}, static_cast<double>(fds));
  rlimit lim{};
  getrlimit(RLIMIT_NOFILE, &lim);
  auto max_fds =
      family("process_max_fds", "Maximum number of open file descriptors.", MetricType::Gauge);
  add(max_fds, {}, static_cast<double>(lim.rlim_cur));
  for (auto* m : {&cpu, &rss, &vsz, &start, &open_fds, &max_fds}) out.push_back(std::move(*m));
}

std::vector<MetricFamily> collect() {
  auto runners = detail::runner_snapshots();
  std::vector<MetricFamily> out;
  auto build = family("troupe_build_info", "troupe's version (always 1).", MetricType::Gauge);
  add(build, {{"version", "0.1.0"}}, 1);
  auto open = family("troupe_runners", "Runners open in this process.", MetricType::Gauge);
  auto submitted =
      family("troupe_jobs_submitted_total", "Jobs submitted to the runner.", MetricType::Counter);
  auto completed = family("troupe_jobs_completed_total",
                          "Jobs that ended, by outcome (succeeded; failed: an error, cancelled "
                          "or past the deadline).",
                          MetricType::Counter);
  auto running =
      family("troupe_jobs_running", "Jobs submitted and not yet ended.", MetricType::Gauge);
  auto items = family("troupe_items_consumed_total", "Outputs taken by the jobs' consumers.",
                      MetricType::Counter);
  auto queued = family("troupe_queued_items",
                       "Items of running jobs (of known size) not yet handed to a producer.",
                       MetricType::Gauge);
  auto duplicated =
      family("troupe_duplicated_items_total",
             "Items worked on a second time as speculative copies.", MetricType::Counter);
  auto split_chunks =
      family("troupe_split_chunks_total",
             "Chunks whose items not yet started went to an idle producer.", MetricType::Counter);
  auto moved = family("troupe_moved_items_total",
                      "Items taken back from a late chunk for an idle producer (worked once).",
                      MetricType::Counter);
  auto splits =
      family("troupe_batch_split_calls_total",
             "Batch producers: calls on halves of a batch that threw.", MetricType::Counter);
  auto p_items =
      family("troupe_producer_items_total", "Items a producer worked on.", MetricType::Counter);
  auto p_busy = family("troupe_producer_busy_seconds_total",
                       "Time a producer spent inside producer::work (a CPU producer's, less "
                       "its waits for a CPU).",
                       MetricType::Counter);
  auto p_restarts =
      family("troupe_producer_restarts_total",
             "Times a producer was replaced by a fresh one on its device.", MetricType::Counter);
  auto p_up =
      family("troupe_producer_up", "1 while a producer takes work, else 0.", MetricType::Gauge);
  auto by_state = family("troupe_producers", "Producer slots by state.", MetricType::Gauge);
  auto chunk_time = family("troupe_chunk_seconds",
                           "Time a producer spent on one chunk (one observation per chunk; a CPU "
                           "producer's, less its waits for a CPU).",
                           MetricType::Histogram);
  auto job_time = family("troupe_job_seconds",
                         "Time from submit() to a job's end (one observation per job ended).",
                         MetricType::Histogram);
  auto last_item = family("troupe_last_item_timestamp_seconds",
                          "When a producer last answered a chunk with outputs (unix time; 0: "
                          "never): a stall shows as its age.",
                          MetricType::Gauge);
  auto queue_wait =
      family("troupe_queue_wait_seconds",
             "How long a chunk's items waited before it was first sent to a producer (from the "
             "job's start for inputs of known size; 0 for generators, pulled when sent).",
             MetricType::Histogram);
  auto batch_hold = family(
      "troupe_batch_hold_seconds",
      "Dynamic batching: how long a producer call was held for more items, from when its "
      "producer was free and an item waited (at most batching.max_delay, plus wake-up latency).",
      MetricType::Histogram);
  auto sent = family("troupe_chunks_sent_total",
                     "Chunks sent to producers: attempt=first once per chunk, again for "
                     "re-dispatches after a loss, retries and speculative copies.",
                     MetricType::Counter);
  auto retries = family("troupe_retries_total",
                        "Items tried again after producer::work threw on them (error_policy).",
                        MetricType::Counter);
  auto skipped = family("troupe_skipped_items_total",
                        "Items skipped after failing every attempt (error_policy::skip).",
                        MetricType::Counter);
  auto node_bytes =
      family("troupe_node_payload_bytes_total",
             "Payload bytes of items sent to producers on nodes and of their outputs received "
             "(numbers, tensors, strings: the items' own bytes, not the wire's framing).",
             MetricType::Counter);
  auto unsized = family("troupe_node_chunks_unsized_total",
                        "Chunks sent to producers on nodes whose items have no flat size (not in "
                        "troupe_node_payload_bytes_total).",
                        MetricType::Counter);
  auto late = family("troupe_late_answers_total",
                     "Answers dropped because their producer had been given up on (fenced).",
                     MetricType::Counter);
  double open_count = 0;
  for (auto& r : runners) {
    open_count += r.open ? 1 : 0;
    auto id = std::to_string(r.id);
    labels rl{{"runner", id}};
    add(submitted, rl, static_cast<double>(r.jobs_submitted));
    auto& s = r.stats;
    add(completed, {{"outcome", "failed"}, {"runner", id}}, static_cast<double>(s.failed_runs));
    add(completed, {{"outcome", "succeeded"}, {"runner", id}},
        static_cast<double>(s.runs - s.failed_runs));
    add(running, rl,
        r.jobs_submitted > s.runs ? static_cast<double>(r.jobs_submitted - s.runs) : 0.0);
    add(items, rl, static_cast<double>(s.items));
    add(queued, rl, static_cast<double>(r.queued_items));
    add(duplicated, rl, static_cast<double>(s.duplicated_items));
    add(splits, rl, static_cast<double>(s.split_calls));
    add(split_chunks, rl, static_cast<double>(s.split_chunks));
    add(moved, rl, static_cast<double>(s.moved_items));
    add(late, rl, static_cast<double>(s.late_answers));
    add_histogram(chunk_time, rl, r.chunk_seconds);
    add_histogram(job_time, rl, r.job_seconds);
    add_histogram(queue_wait, rl, r.queue_wait);
    if (r.batch_hold.count > 0) add_histogram(batch_hold, rl, r.batch_hold);
    add(retries, rl, static_cast<double>(r.retries));
    add(node_bytes, {{"direction", "sent"}, {"runner", id}},
        static_cast<double>(r.node_bytes_sent));
    add(node_bytes, {{"direction", "received"}, {"runner", id}},
        static_cast<double>(r.node_bytes_received));
    add(unsized, rl, static_cast<double>(r.node_chunks_unsized));
    add(skipped, rl, static_cast<double>(r.skipped_items));
    add(sent, {{"attempt", "first"}, {"runner", id}}, static_cast<double>(r.chunks_first_sent));
    add(sent, {{"attempt", "again"}, {"runner", id}},
        static_cast<double>(r.chunks_sent - std::min(r.chunks_sent, r.chunks_first_sent)));
    add(last_item, rl, r.last_item_unix_seconds);
    double up = 0, lost = 0, quarantined = 0, removed = 0;
    for (auto& p : s.producers) {
      labels pl{{"device", p.where.str()}, {"producer", std::to_string(p.index)}, {"runner", id}};
      add(p_items, pl, static_cast<double>(p.items));
      add(p_busy, pl, std::chrono::duration<double>(p.busy).count());
      add(p_restarts, pl, static_cast<double>(p.restarts));
      add(p_up, pl, p.alive ? 1 : 0);
      if (p.removed)
        removed += 1;
      else if (p.quarantined)
        quarantined += 1;
      else if (p.alive)
        up += 1;
      else
        lost += 1;
    }
    add(by_state, {{"runner", id}, {"state", "up"}}, up);
    add(by_state, {{"runner", id}, {"state", "lost"}}, lost);
    add(by_state, {{"runner", id}, {"state", "quarantined"}}, quarantined);
    add(by_state, {{"runner", id}, {"state", "removed"}}, removed);
  }
  add(open, {}, open_count);
  auto members = family("troupe_cluster_members",
                        "Nodes a live cluster of this process knows, by state.", MetricType::Gauge);
  auto fenced =
      family("troupe_cluster_fenced_answers_total",
             "Answers of node processes a cluster had given up on, dropped.", MetricType::Counter);
  for (auto& c : detail::cluster_views()) {
    auto id = std::to_string(c.id);
    for (auto st : {member::state::up, member::state::draining, member::state::drained,
                    member::state::lost}) {
      double n = 0;
      for (auto& m : c.members) n += m.what == st ? 1 : 0;
      add(members, {{"cluster", id}, {"state", to_string(st)}}, n);
    }
    add(fenced, {{"cluster", id}}, static_cast<double>(c.fenced_answers));
  }
  // What the producers living in this process worked: a node's for its coordinators, and the
  // local producers of this process's runners.
  auto& work = detail::process_work();
  auto worked_chunks = family("troupe_worked_chunks_total",
                              "Chunks worked by the producers living in this process (a node's "
                              "for its coordinators, and local ones), by outcome.",
                              MetricType::Counter);
  auto failed = static_cast<double>(work.failed_chunks.load(std::memory_order_relaxed));
  add(worked_chunks, {{"outcome", "ok"}},
      static_cast<double>(work.ok_chunks.load(std::memory_order_relaxed)));
  add(worked_chunks, {{"outcome", "failed"}}, failed);
  auto worked_items = family("troupe_worked_items_total",
                             "Items in the chunks worked by the producers living in this process.",
                             MetricType::Counter);
  add(worked_items, {}, static_cast<double>(work.items.load(std::memory_order_relaxed)));
  auto work_seconds = family("troupe_work_seconds_total",
                             "Time the producers living in this process spent working chunks.",
                             MetricType::Counter);
  add(work_seconds, {}, static_cast<double>(work.busy_ns.load(std::memory_order_relaxed)) * 1e-9);
  for (auto* f : {&worked_chunks, &worked_items, &work_seconds}) out.push_back(std::move(*f));
  // The nodes this process serves (node::serve), by the address each listens on.
  using node = detail::node_view;
  static const series<node> node_series[] = {
      {"troupe_node_producers",
       "Producers a node of this process runs now, for all its coordinators.", MetricType::Gauge,
       [](const node& n) { return static_cast<double>(n.producers); }},
      {"troupe_node_coordinators", "Coordinators with producers on a node of this process now.",
       MetricType::Gauge, [](const node& n) { return static_cast<double>(n.coordinators); }},
      {"troupe_node_watchers", "Clusters watching a node of this process (told when it drains).",
       MetricType::Gauge, [](const node& n) { return static_cast<double>(n.watchers); }},
      {"troupe_node_draining", "1 while a node of this process drains, else 0.", MetricType::Gauge,
       [](const node& n) { return n.draining ? 1.0 : 0.0; }},
      {"troupe_node_producers_spawned_total",
       "Producers a node of this process started for its coordinators.", MetricType::Counter,
       [](const node& n) { return static_cast<double>(n.producers_spawned); }},
      {"troupe_node_spawns_refused_total",
       "Producer requests a node of this process refused (draining, limits, an unknown job, a "
       "device it does not offer).",
       MetricType::Counter, [](const node& n) { return static_cast<double>(n.spawns_refused); }},
  };
  add_series(out, node_series, detail::node_views(), "node",
             [](const node& n) { return n.address; });
  // data_parallel trainers of this process (published after each step), by their number.
  using trainer = detail::trainer_view;
  static const series<trainer> trainer_series[] = {
      {"troupe_train_steps_total", "Training steps completed.", MetricType::Counter,
       [](const trainer& t) { return static_cast<double>(t.steps); }},
      {"troupe_train_shards_total", "Shards in the completed steps.", MetricType::Counter,
       [](const trainer& t) { return static_cast<double>(t.shards); }},
      {"troupe_train_recomputed_shards_total",
       "Shards computed again on survivors after their replica was lost.", MetricType::Counter,
       [](const trainer& t) { return static_cast<double>(t.recomputed_shards); }},
      {"troupe_train_lost_replicas_total", "Replicas lost (node lost, timeout, failed step).",
       MetricType::Counter, [](const trainer& t) { return static_cast<double>(t.lost_replicas); }},
      {"troupe_train_ring_reductions_total",
       "Steps whose gradients the replicas all-reduced among themselves in a ring.",
       MetricType::Counter,
       [](const trainer& t) { return static_cast<double>(t.ring_reductions); }},
      {"troupe_train_reduce_seconds_total",
       "Time summing gradients (coordinator or ring) and applying the update.", MetricType::Counter,
       [](const trainer& t) { return t.reduce_seconds; }},
      {"troupe_train_step_seconds_total", "Wall time of the completed steps.", MetricType::Counter,
       [](const trainer& t) { return t.step_seconds; }},
      {"troupe_train_replicas", "Replicas alive now.", MetricType::Gauge,
       [](const trainer& t) { return static_cast<double>(t.replicas); }},
  };
  add_series(out, trainer_series, detail::trainers().views(), "trainer",
             [](const trainer& t) { return std::to_string(t.id); });
  for (auto* f :
       {&build,      &open,       &submitted, &completed,  &running, &items,      &queued,
        &duplicated, &splits,     &late,      &p_items,    &p_busy,  &p_restarts, &p_up,
        &by_state,   &chunk_time, &job_time,  &queue_wait, &sent,    &retries,    &skipped,
        &node_bytes, &unsized,    &last_item, &members,    &fenced})
    out.push_back(std::move(*f));
  process_metrics(out);
  return out;
}

}  // namespace

std::string metrics_text() {
  return prometheus::TextSerializer{}.Serialize(collect());
}

}  // namespace troupe
