// A node program started as a child process for the tests (`--serve 127.0.0.1:0` and the
// program's other flags), its address read from its "serving on HOST:PORT" line; SIGKILLed by
// the destructor.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace test_util {

class node_process {
 public:
  /// Runs `program --serve SERVE --devices devices extra...` (SERVE: 127.0.0.1:0, any free
  /// port, unless given).
  node_process(const std::string& program, const std::string& devices,
               std::vector<std::string> extra = {}, const std::string& serve = "127.0.0.1:0") {
    // The arguments are made before fork(): the child of a process with other threads may only
    // call async-signal-safe functions until it execs (an allocation there can wait forever
    // for a lock another thread held at the fork, e.g. a connect still under way: it hung an
    // ASan CI run once).
    std::vector<std::string> args{program, "--serve", serve, "--devices", devices};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int out[2];
    if (pipe(out) != 0) throw std::runtime_error("pipe");
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork");
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(out[1]);
    out_ = fdopen(out[0], "r");
    char line[256] = {0};
    // "serving on 127.0.0.1:PORT" (ctest's timeout bounds this read)
    if (fgets(line, sizeof line, out_) == nullptr) throw std::runtime_error("node did not start");
    std::string text = line;
    auto at = text.find("serving on ");
    if (at == std::string::npos) throw std::runtime_error("node said: " + text);
    address_ = text.substr(at + 11);
    address_.erase(address_.find_last_not_of("\r\n") + 1);
  }
  node_process(const node_process&) = delete;
  node_process& operator=(const node_process&) = delete;
  ~node_process() {
    if (pid_ > 0) {  // never kill(-1, ...): that signals every process we may signal
      ::kill(pid_, SIGCONT);
      ::kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_) fclose(out_);
  }

  void kill(int sig) const {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  pid_t pid() const { return pid_; }
  /// False once the process has ended (crashed, say).
  bool alive() const {
    int status = 0;
    return pid_ > 0 && waitpid(pid_, &status, WNOHANG) == 0;
  }
  /// True once the process has ended (it is reaped then); `signal` gets the signal that ended
  /// it (0: none).
  bool ended(int* signal = nullptr, int* code = nullptr) {
    int status = 0;
    if (pid_ <= 0 || waitpid(pid_, &status, WNOHANG) != pid_) return false;
    if (signal) *signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    if (code) *code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    pid_ = -1;
    return true;
  }
  /// "127.0.0.1:PORT"
  const std::string& address() const { return address_; }
  std::uint16_t port() const {
    return static_cast<std::uint16_t>(std::stoi(address_.substr(address_.rfind(':') + 1)));
  }

 private:
  pid_t pid_ = -1;
  FILE* out_ = nullptr;
  std::string address_;
};

}  // namespace test_util
