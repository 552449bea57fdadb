// troupe::metrics_text and troupe::serve_metrics: what this process's runners are doing, in the
// Prometheus text format (docs/api.md, "Watching it run"). Link troupe::metrics (built when
// Debian's prometheus-cpp-dev is found).
#pragma once

#include <memory>
#include <string>

namespace troupe {

/// Every runner of this process, in the Prometheus text format (version 0.0.4): names with the
/// troupe_ prefix, base units, _total counters; labels name a runner, a producer slot and its
/// device, never a job or an item (the series stay bounded whatever the number of jobs); and the
/// standard process_* metrics.
std::string metrics_text();

/// Every runner of this process as JSON: ids, jobs, items, and each producer's device, state,
/// items and busy seconds (what the status page shows).
std::string status_json();

/// A server, on its own threads until destroyed, of GET /metrics (metrics_text()),
/// GET /status.json (status_json()) and GET / (a live status page: self-contained, no script
/// from elsewhere, it polls /status.json every second).
class metrics_server {
 public:
  metrics_server(metrics_server&&) noexcept;
  metrics_server& operator=(metrics_server&&) noexcept;
  ~metrics_server();
  /// "HOST:PORT" it listens on (the port it was given, or the one chosen for port 0).
  [[nodiscard]] std::string address() const;

 private:
  struct impl;
  explicit metrics_server(std::unique_ptr<impl> i);
  friend metrics_server serve_metrics(const std::string& host_port);
  std::unique_ptr<impl> impl_;
};

/// Serves on "HOST:PORT" (port 0: any free one; address() tells which). Throws
/// troupe::invalid_argument for a malformed address or when it cannot listen there.
metrics_server serve_metrics(const std::string& host_port);

}  // namespace troupe
