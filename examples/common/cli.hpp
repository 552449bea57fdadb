// Command-line flags shared by every example (API.md §6), parsed with CLI11.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <troupe/troupe.hpp>
#include <vector>

namespace example {

struct flags {
  std::string devices = "cpu,cpu";
  std::size_t items = 100;
  bool ordered = false;
  double work_ms = 0;
  std::string serve, nodes, tls_cert, tls_key, tls_ca;
  bool verbose = false;

  std::vector<troupe::device> device_list() const {
    std::vector<troupe::device> out;
    std::size_t start = 0;
    while (start <= devices.size()) {
      auto comma = devices.find(',', start);
      auto spec =
          devices.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (!spec.empty()) out.emplace_back(spec);
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    return out;
  }
};

/// Adds the common flags to `app`; examples add their own before parsing.
inline void add_flags(CLI::App& app, flags& f) {
  app.add_option("--devices", f.devices, "comma-separated device specs, e.g. cpu,cpu or cuda:0");
  app.add_option("--items", f.items, "how many input items");
  app.add_flag("--ordered", f.ordered, "use the ordered runner");
  app.add_option("--work-ms", f.work_ms, "simulated device time per item, in ms");
  app.add_option("--serve", f.serve, "run as a node on HOST:PORT (not implemented yet)");
  app.add_option("--nodes", f.nodes, "HOST:PORT list of nodes to use (not implemented yet)");
  app.add_option("--tls-cert", f.tls_cert, "TLS certificate (not implemented yet)");
  app.add_option("--tls-key", f.tls_key, "TLS key (not implemented yet)");
  app.add_option("--tls-ca", f.tls_ca, "TLS CA (not implemented yet)");
  app.add_flag("-v,--verbose", f.verbose, "log troupe's diagnostics to stderr");
}

/// Checks flags that this version cannot honour yet; returns an exit code, or -1 to go on.
inline int check_flags(const flags& f) {
  if (f.verbose) troupe::log_to_stderr(troupe::log_level::debug);
  if (!f.serve.empty() || !f.nodes.empty() || !f.tls_cert.empty()) {
    std::cerr << "error: --serve, --nodes and the TLS flags need multi-node support, which this "
                 "version of troupe does not have yet\n";
    return 2;
  }
  return -1;
}

/// Sleeps for the simulated device time of one item.
inline void simulate_work(double ms) {
  if (ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
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
