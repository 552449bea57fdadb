// /status.json (troupe::status_json, metrics.hpp): the runners, clusters, nodes and work of
// this process as JSON, for the live page and for scripts (schema: docs/status.schema.json).
#include <chrono>
#include <sstream>
#include <string>

#include "metrics_parts.hpp"
#include "troupe/detail/cluster_state.hpp"
#include "troupe/detail/introspect.hpp"
#include "troupe/detail/json.hpp"
#include "troupe/detail/node_view.hpp"
#include "troupe/metrics.hpp"

namespace troupe {

namespace {

std::string number(double v) {
  std::ostringstream o;
  o.precision(17);
  o << v;
  return o.str();
}

}  // namespace

std::string status_json() {
  auto runners = detail::runner_snapshots();
  std::ostringstream o;
  auto now = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch());
  o << "{\"time_seconds\":" << number(now.count()) << ",\"runners\":[";
  bool first = true;
  for (auto& r : runners) {
    auto& s = r.stats;
    o << (first ? "" : ",") << "{\"id\":" << r.id << ",\"open\":" << (r.open ? "true" : "false")
      << ",\"jobs_submitted\":" << r.jobs_submitted
      << ",\"jobs_running\":" << (r.jobs_submitted > s.runs ? r.jobs_submitted - s.runs : 0)
      << ",\"jobs_failed\":" << s.failed_runs << ",\"items\":" << s.items
      << ",\"queued_items\":" << r.queued_items << ",\"duplicated_items\":" << s.duplicated_items
      << ",\"producers\":[";
    first = false;
    bool first_p = true;
    for (auto& p : s.producers) {
      o << (first_p ? "" : ",") << "{\"index\":" << p.index
        << ",\"device\":" << detail::json_quote(p.where.str()) << ",\"items\":" << p.items
        << ",\"busy_seconds\":" << number(std::chrono::duration<double>(p.busy).count())
        << ",\"alive\":" << (p.alive ? "true" : "false")
        << ",\"removed\":" << (p.removed ? "true" : "false")
        << ",\"quarantined\":" << (p.quarantined ? "true" : "false")
        << ",\"restarts\":" << p.restarts << "}";
      first_p = false;
    }
    o << "],\"jobs\":[";
    first_p = true;
    for (auto& j : r.running_jobs) {
      o << (first_p ? "" : ",") << "{\"id\":" << j.id << ",\"done\":" << j.now.done
        << ",\"total\":" << (j.now.total ? std::to_string(*j.now.total) : std::string{"null"})
        << ",\"items_per_second\":" << number(j.now.items_per_second)
        << ",\"elapsed_seconds\":" << number(j.now.elapsed_seconds) << "}";
      first_p = false;
    }
    o << "]}";
  }
  o << "],\"clusters\":[";
  first = true;
  for (auto& c : detail::cluster_views()) {
    o << (first ? "" : ",") << "{\"id\":" << c.id << ",\"fenced_answers\":" << c.fenced_answers
      << ",\"members\":[";
    first = false;
    bool first_m = true;
    for (auto& m : c.members) {
      o << (first_m ? "" : ",") << "{\"address\":" << detail::json_quote(m.address)
        << ",\"incarnation\":" << detail::json_quote(std::to_string(m.incarnation))
        << ",\"state\":" << detail::json_quote(to_string(m.what))
        << ",\"devices\":" << m.devices.size() << "}";
      first_m = false;
    }
    o << "]}";
  }
  o << "],\"nodes\":[";
  first = true;
  for (auto& n : detail::node_views()) {
    o << (first ? "" : ",") << "{\"address\":" << detail::json_quote(n.address)
      << ",\"incarnation\":" << detail::json_quote(std::to_string(n.incarnation))
      << ",\"draining\":" << (n.draining ? "true" : "false") << ",\"producers\":" << n.producers
      << ",\"coordinators\":" << n.coordinators << ",\"watchers\":" << n.watchers
      << ",\"producers_spawned\":" << n.producers_spawned
      << ",\"spawns_refused\":" << n.spawns_refused << "}";
    first = false;
  }
  auto& work = detail::process_work();
  o << "],\"work\":{\"chunks\":"
    << work.ok_chunks.load(std::memory_order_relaxed) +
           work.failed_chunks.load(std::memory_order_relaxed)
    << ",\"failed_chunks\":" << work.failed_chunks.load(std::memory_order_relaxed)
    << ",\"items\":" << work.items.load(std::memory_order_relaxed) << ",\"busy_seconds\":"
    << number(static_cast<double>(work.busy_ns.load(std::memory_order_relaxed)) * 1e-9) << "}}";
  return o.str();
}

}  // namespace troupe
