// Command-line flags shared by every example (docs/api.md, "Several machines"), parsed with CLI11.
#pragma once

#include <pthread.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <troupe/troupe.hpp>
#ifdef TROUPE_EXAMPLES_METRICS
#include <troupe/metrics.hpp>
#endif
#include <utility>
#include <vector>

#include "common/progress.hpp"

namespace example {

struct flags {
  std::string devices = "cpu,cpu";
  bool devices_given = false;
  std::size_t items = 100;
  bool ordered = false;
  double work_ms = 0;
  /// Whether the example takes --work-ms (its producers simulate device time per item); set
  /// before add_flags. Elsewhere the flag is refused, not ignored.
  bool simulated_work = false;
  std::string serve, nodes, tls_cert, tls_key, tls_ca;
  bool verbose = false;
  std::int64_t work_timeout_ms = 0;
  std::size_t chunk_size = 0;              ///< --chunk-size: options::chunk_size (0: automatic)
  troupe::limits limits;                   ///< --max-message-mb, --handshake-timeout-ms, ...
  std::string progress = "auto";           ///< --progress auto|on|off (common/progress.hpp)
  std::int64_t progress_every_ms = 1000;   ///< --progress-every-ms: period of the plain lines
  std::string trace;                       ///< --trace FILE: options::trace_file
  std::string metrics;                     ///< --metrics HOST:PORT: troupe::serve_metrics
  std::int64_t drain_timeout_ms = 30'000;  ///< --drain-timeout-ms: a node's drain on SIGTERM
  std::string discover;                    ///< --discover NAME:PORT: troupe::dns_discovery
  std::size_t min_nodes = 0;               ///< --min-nodes: cluster_options::min_nodes
  std::size_t probes_per_second = 100;     ///< --probes-per-second: cluster_options::...

  /// Runner options from the flags.
  troupe::options options() const {
    troupe::options o;
    o.work_timeout = std::chrono::milliseconds{work_timeout_ms};
    o.chunk_size = chunk_size;
    o.trace_file = trace;
    return o;
  }

  /// Runner options with on_progress feeding `display`.
  troupe::options options(progress_display& display) const {
    auto o = options();
    o.on_progress = display.callback();
    return o;
  }

  /// Progress on stderr as the --progress flags ask (common/progress.hpp).
  progress_display make_progress(std::string unit = "items",
                                 std::string workers = "producers") const {
    return progress_display{parse_progress_mode(progress),
                            std::chrono::milliseconds{progress_every_ms}, verbose, std::move(unit),
                            std::move(workers)};
  }

  troupe::tls tls() const { return {tls_cert, tls_key, tls_ca, {}}; }

  /// --nodes or --discover alone: a live cluster that runners built from it follow (a node
  /// restarted on its address rejoins the running job; one that drains leaves it; with
  /// --discover, addresses that appear join and those that vanish drain); membership changes
  /// are printed on stderr. Nothing otherwise.
  std::optional<troupe::cluster> live_cluster() const {
    if ((nodes.empty() && discover.empty()) || devices_given) return std::nullopt;
    troupe::cluster_options o;
    o.min_nodes = min_nodes;
    o.probes_per_second = probes_per_second;
    if (!discover.empty()) {
      o.discover = troupe::dns_discovery(discover);
      o.discover_every = std::chrono::milliseconds{1000};
    }
    o.on_change = [](const troupe::membership_event& e) {
      std::cerr << "cluster: " << e.node << " " << troupe::to_string(e.what) << " (incarnation "
                << std::hex << e.incarnation << std::dec << ")" << std::endl;
    };
    return troupe::cluster::connect(split(nodes), tls(), o);
  }

  /// A runner over the live cluster of --nodes (following it), else over device_list().
  template <class Runner>
  Runner runner(const troupe::config& cfg, troupe::options o) const {
    if (auto c = live_cluster()) return Runner{*c, cfg, std::move(o)};
    return Runner{device_list(), cfg, std::move(o)};
  }

  /// --devices, or the devices of the --nodes and of what --discover finds now (plus --devices
  /// when given too).
  std::vector<troupe::device> device_list() const {
    std::vector<troupe::device> out;
    auto addresses = split(nodes);
    if (!discover.empty()) {  // once: these programs do not follow a cluster
      auto found = troupe::dns_discovery(discover)();
      addresses.insert(addresses.end(), found.begin(), found.end());
    }
    if (!addresses.empty()) {
      troupe::cluster_options o;
      o.min_nodes = min_nodes;  // 0: every node must answer; else those that answer now
      out = troupe::cluster::connect(addresses, tls(), o).devices();
    }
    if (addresses.empty() || devices_given)
      for (auto& spec : split(devices)) out.emplace_back(spec);
    return out;
  }

  static std::vector<std::string> split(const std::string& list) {
    std::vector<std::string> out;
    std::size_t start = 0;
    while (start <= list.size()) {
      auto comma = list.find(',', start);
      auto item =
          list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      // "a, b": spaces around an entry are not part of it (" b" was a host name not found).
      auto first = item.find_first_not_of(" \t"), last = item.find_last_not_of(" \t");
      item = first == std::string::npos ? "" : item.substr(first, last + 1 - first);
      if (!item.empty()) out.push_back(item);
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    return out;
  }
};

/// A simulated cost in ms: a finite number from 0 to a day (inf and nan skipped the work).
inline const CLI::Validator finite_ms{
    [](std::string& v) -> std::string {
      double x = 0;
      try {
        x = std::stod(v);
      } catch (...) {
        return "not a number: " + v;
      }
      return std::isfinite(x) && x >= 0 && x <= 86'400'000 ? "" : "from 0 to 86400000 ms: " + v;
    },
    "MS", "finite_ms"};

/// Adds the common flags to `app`; examples add their own before parsing.
inline void add_flags(CLI::App& app, flags& f) {
  app.add_option("--devices", f.devices, "comma-separated device specs, e.g. cpu,cpu or cuda:0")
      ->each([&f](const std::string&) { f.devices_given = true; });
  app.add_option("--items", f.items, "how many input items");
  app.add_flag("--ordered", f.ordered, "use the ordered runner");
  if (f.simulated_work)
    app.add_option("--work-ms", f.work_ms,
                   "simulated device time per item, in ms (a sleep; below 0.1 ms the CPU spins)")
        ->check(finite_ms);
  app.add_option("--work-timeout-ms", f.work_timeout_ms,
                 "give up on a producer that has not answered a chunk for this long (0: never)");
  app.add_option("--chunk-size", f.chunk_size,
                 "items per chunk, fixed (options::chunk_size; default 0: automatic)");
  app.add_option("--serve", f.serve, "run as a node on HOST:PORT until SIGINT/SIGTERM");
  app.add_option("--nodes", f.nodes, "comma-separated HOST:PORT of nodes whose devices to use");
  app.add_option("--discover", f.discover,
                 "NAME:PORT: use every node the DNS name resolves to (a Kubernetes headless "
                 "service); programs that follow a cluster (sum_of_squares) poll it every "
                 "second: nodes that appear join, those that vanish drain; the others resolve "
                 "it once, at start")
      ->check([](const std::string& v) {  // an unset variable in a manifest: said, not ignored
        return v.find_first_not_of(" \t") == std::string::npos ? "an empty name" : "";
      });
  app.add_option("--min-nodes", f.min_nodes,
                 "with --nodes/--discover: start with the nodes that answer within the connect "
                 "timeout, an error if fewer than this many (0: every node must answer); in "
                 "programs that follow a cluster the others join when they answer")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1'000'000}));
  app.add_option("--probes-per-second", f.probes_per_second,
                 "with --nodes/--discover: ask the members for a sign of life at most this often "
                 "in all (default 100; 0: every member every 200 ms)")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1'000'000}));
  app.add_option("--tls-cert", f.tls_cert, "TLS certificate (PEM), for mutual TLS");
  app.add_option("--tls-key", f.tls_key, "TLS private key (PEM)");
  app.add_option("--tls-ca", f.tls_ca, "CA certificate (PEM) that signs the peers");
  app.add_flag("-v,--verbose", f.verbose, "log troupe's diagnostics to stderr");
  app.add_option("--trace", f.trace,
                 "write Chrome trace events (Perfetto, chrome://tracing) of the runners to FILE");
  app.add_option("--metrics", f.metrics,
                 "serve Prometheus metrics (/metrics), /status.json and a live page (/) on "
                 "HOST:PORT while the program runs");
  app.add_option("--drain-timeout-ms", f.drain_timeout_ms,
                 "--serve: on SIGTERM/SIGINT, how long the node drains (its producers finish "
                 "their chunks) before it stops (default 30000); a second signal stops it at once")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{86'400'000}));
  app.add_option("--progress", f.progress,
                 "progress on stderr: on (a bar on a terminal, else a line per period, and a "
                 "summary), off, or auto (default: the bar on a terminal; elsewhere lines and "
                 "the summary only for runs longer than a period)")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  app.add_option("--progress-every-ms", f.progress_every_ms,
                 "period of the progress lines when stderr is not a terminal (default 1000)")
      ->check(CLI::PositiveNumber);
  // Network limits (docs/deploy.md): what this process accepts from its peers.
  app.add_option_function<std::size_t>(
         "--max-message-mb", [&f](std::size_t mb) { f.limits.max_message_bytes = mb << 20; },
         "largest message a peer may send, in MiB (default 64)")
      ->check(CLI::Range(std::size_t{1}, std::size_t{4095}));  // under 4 GiB
  app.add_option_function<std::int64_t>(
      "--handshake-timeout-ms",
      [&f](std::int64_t ms) { f.limits.handshake_timeout = std::chrono::milliseconds{ms}; },
      "close connections that have not completed the handshake in this time (default 10000)");
  app.add_option_function<std::int64_t>(
      "--idle-timeout-ms",
      [&f](std::int64_t ms) { f.limits.idle_timeout = std::chrono::milliseconds{ms}; },
      "give up on a connected peer silent for this long (default 1500)");
  app.add_option_function<std::int64_t>(
      "--heartbeat-ms",
      [&f](std::int64_t ms) { f.limits.heartbeat = std::chrono::milliseconds{ms}; },
      "send a heartbeat on every connection this often (default 200; at most half "
      "--idle-timeout-ms)");
  app.add_option("--max-connections", f.limits.max_connections,
                 "most connections kept open (default 256)");
  app.add_option("--max-producers-per-coordinator", f.limits.max_producers_per_coordinator,
                 "most producers one coordinator may have on this node (default 256)");
}

/// Serves this program's devices as a node until SIGINT or SIGTERM, then drains (its producers
/// finish their chunks and leave gracefully; a second signal stops it at once).
inline int serve(const flags& f) {
  troupe::node_options o;
  static_cast<troupe::limits&>(o) = f.limits;
  o.drain_timeout = std::chrono::milliseconds{f.drain_timeout_ms};
  o.on_serving = [](const troupe::node& n) {
    std::cout << "serving on " << n.address() << std::endl;
  };
  int rc = troupe::node::serve_until_signal(f.serve, f.device_list(), f.tls(), o);
  std::cout << "stopped" << std::endl;
  return rc;
}

/// --metrics: a server of /metrics, /status.json and the live page for the program's life.
inline int start_metrics(const flags& f) {
  if (f.metrics.empty()) return -1;
#ifdef TROUPE_EXAMPLES_METRICS
  try {
    static std::optional<troupe::metrics_server> server;
    server.emplace(troupe::serve_metrics(f.metrics));
    std::cerr << "metrics on http://" << server->address() << "/ (/metrics, /status.json)"
              << std::endl;
    return -1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
#else
  std::cerr << "error: --metrics: this build has no troupe::metrics (install "
               "prometheus-cpp-dev and libboost1.81-dev, and build again)\n";
  return 1;
#endif
}

/// Handles --serve and --verbose; returns an exit code, or -1 to go on with the example.
inline int check_flags(const flags& f) {
  if (f.verbose) troupe::log_to_stderr(troupe::log_level::debug);
  try {
    troupe::set_network_limits(f.limits);  // before any network use
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  if (int rc = start_metrics(f); rc >= 0) return rc;
  if (!f.serve.empty()) {
    int rc = 1;
    try {
      rc = serve(f);
    } catch (const std::exception& e) {
      std::cerr << "error: " << e.what() << "\n";
    }
    return rc;
  }
  return -1;
}

/// The simulated device time of one item: a sleep (a GPU's work leaves the CPU free), except
/// below 0.1 ms, where a sleep would last tens of microseconds more than asked: there the CPU
/// spins, as short work would.
inline void simulate_work(double ms) {
  if (ms <= 0) return;
  auto d = std::chrono::duration<double, std::milli>(ms);
  if (ms >= 0.1) {
    std::this_thread::sleep_for(d);
    return;
  }
  auto until = std::chrono::steady_clock::now() +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(d);
  while (std::chrono::steady_clock::now() < until) {
  }
}

/// Runs `body`, turning troupe's exceptions into a message and exit code 1.
template <class F>
int guarded(F&& body) {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace example
