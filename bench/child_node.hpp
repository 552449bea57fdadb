// A node for the benchmarks: this program started again as a child process with
// `--serve 127.0.0.1:0 --devices DEVICES` and `extra` arguments; ended (SIGTERM) on destruction.
#pragma once

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

struct child_node {
  pid_t pid = -1;
  std::string address;  ///< "127.0.0.1:PORT", as the node printed it
  std::uint16_t port = 0;

  child_node(const char* self, const std::string& devices, std::vector<std::string> extra = {}) {
    // Made before fork(): the child may only call async-signal-safe functions until it execs.
    std::vector<std::string> args{self, "--serve", "127.0.0.1:0", "--devices", devices};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int out[2];
    if (pipe(out) != 0) throw std::runtime_error("pipe");
    pid = fork();
    if (pid == 0) {
      // Ends with the benchmark, also when it crashes or is killed (no orphaned node).
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      dup2(out[1], STDOUT_FILENO);
      execv(self, argv.data());
      _exit(127);
    }
    close(out[1]);
    char line[128] = {0};
    FILE* in = fdopen(out[0], "r");
    if (fgets(line, sizeof line, in) == nullptr) throw std::runtime_error("node did not start");
    address = std::string{line}.substr(11);  // after "serving on "
    address.erase(address.find_last_not_of("\n") + 1);
    port = static_cast<std::uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
  }
  child_node(const child_node&) = delete;
  child_node& operator=(const child_node&) = delete;
  ~child_node() {
    kill(pid, SIGTERM);  // the node drains (its coordinator is gone or ends its producers)
    waitpid(pid, nullptr, 0);
  }
};
