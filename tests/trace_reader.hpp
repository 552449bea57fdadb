// Reading the trace a runner writes (options::trace_file, docs/api.md "Watching it run"):
// Chrome trace events, one per line, as Perfetto loads them.
#pragma once

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace test_util {

// options::trace_file (docs/api.md, "Watching it run"): Chrome trace events Perfetto loads.
struct trace_event {
  std::string ph, name;
  int pid = 0, tid = 0;
  double ts = 0, dur = 0;
};

/// The events of a trace written one per line (as troupe writes them).
inline std::vector<trace_event> read_trace(const std::string& path, std::string* text = nullptr) {
  std::ifstream in(path);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text) *text = all;
  std::vector<trace_event> out;
  std::istringstream lines(all);
  std::string line;
  auto field = [](const std::string& l, const std::string& key) -> std::string {
    auto at = l.find("\"" + key + "\":");
    if (at == std::string::npos) return {};
    at += key.size() + 3;
    if (l[at] == '"') return l.substr(at + 1, l.find('"', at + 1) - at - 1);
    return l.substr(at, l.find_first_of(",}", at) - at);
  };
  while (std::getline(lines, line)) {
    if (line.rfind("{\"ph\"", 0) != 0) continue;
    trace_event e;
    e.ph = field(line, "ph");
    e.name = field(line, "name");
    e.pid = std::stoi(field(line, "pid"));
    e.tid = std::stoi(field(line, "tid"));
    if (auto ts = field(line, "ts"); !ts.empty()) e.ts = std::stod(ts);
    if (auto dur = field(line, "dur"); !dur.empty()) e.dur = std::stod(dur);
    out.push_back(e);
  }
  return out;
}

/// python3's json module accepts the file (skipped, true, without python3).
inline bool valid_json(const std::string& path) {
  if (std::system("command -v python3 >/dev/null 2>&1") != 0) return true;
  auto cmd = "python3 -c 'import json,sys; json.load(open(sys.argv[1]))' " + path;
  return std::system(cmd.c_str()) == 0;
}

}  // namespace test_util
