// serve's model file, read once (examples/serve.cpp): a copy of it, and of its FILE.ref.txt, in
// a private directory, which every later load reads. The reference check, each device's copy of
// the weights and the self-test's scores all load the model: from the file itself, one rewritten
// while serve starts would be checked in one version and served in another.
#pragma once

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace {

class model_snapshot {
 public:
  /// Copies `file` (and `file`.ref.txt, if there is one) into a new directory under $TMPDIR (or
  /// /tmp), named after this process; first removes those that processes no longer running left
  /// there (killed, they could not). A file that changes while it is copied is copied again (up
  /// to 5 times, 100 ms apart): throws when it kept changing, or cannot be read or copied.
  explicit model_snapshot(const std::string& file) {
    namespace fs = std::filesystem;
    const char* tmp = std::getenv("TMPDIR");
    std::string under = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
    remove_stale(under);
    std::string pattern = under + "/" + prefix + std::to_string(::getpid()) + "-XXXXXX";
    std::vector<char> name(pattern.begin(), pattern.end());
    name.push_back('\0');
    if (::mkdtemp(name.data()) == nullptr)
      throw std::runtime_error("serve: cannot make a directory for the model's copy (" + pattern +
                               "): " + std::generic_category().message(errno));
    dir_ = name.data();
    try {
      path_ = dir_ + "/" + fs::path{file}.filename().string();
      copy_together(file, path_);
    } catch (...) {
      remove_dir();
      throw;
    }
  }
  model_snapshot(const model_snapshot&) = delete;
  model_snapshot& operator=(const model_snapshot&) = delete;
  ~model_snapshot() { remove_dir(); }

  /// The copy of the file, under its own name (its extension says what it is).
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  static constexpr const char* prefix = "troupe-serve-";

  /// What tells one version of a file from the next.
  struct version {
    dev_t dev = 0;
    ino_t ino = 0;
    off_t size = 0;
    timespec mtime{};
    bool operator==(const version& o) const {
      return dev == o.dev && ino == o.ino && size == o.size && mtime.tv_sec == o.mtime.tv_sec &&
             mtime.tv_nsec == o.mtime.tv_nsec;
    }
  };
  static version version_of(const std::string& file) {
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0)
      throw std::runtime_error(file + ": " + std::generic_category().message(errno));
    if (!S_ISREG(st.st_mode)) throw std::runtime_error(file + ": not a regular file");
    return {st.st_dev, st.st_ino, st.st_size, st.st_mtim};
  }

  static void copy(const std::string& from, const std::string& to) {
    std::error_code ec;
    std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing, ec);
    if (ec) throw std::runtime_error("cannot copy " + from + " to " + to + ": " + ec.message());
  }

  /// The model and its reference rows, copied while neither changed: a model rewritten between
  /// the two copies would be checked against another version's rows. An empty model is one being
  /// rewritten (cp truncates it first).
  static void copy_together(const std::string& file, const std::string& to) {
    auto ref = file + ".ref.txt";
    for (int attempt = 0; attempt < 5; ++attempt) {
      if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds{100});
      auto before = version_of(file);
      if (before.size == 0) continue;
      copy(file, to);
      bool has_ref = std::filesystem::exists(ref);
      version ref_before{};
      if (has_ref) {
        ref_before = version_of(ref);
        copy(ref, to + ".ref.txt");
      }
      if (version_of(file) == before && (!has_ref || version_of(ref) == ref_before)) return;
    }
    throw std::runtime_error(file +
                             " kept changing (or stayed empty) while serve read it: write "
                             "the model elsewhere and move it into place");
  }

  /// Removes the directories of processes no longer running (their number is in the name), and
  /// any of this process's number (an earlier process's, killed: numbers are reused).
  static void remove_stale(const std::string& under) {
    namespace fs = std::filesystem;
    std::error_code ec;
    for (fs::directory_iterator it{under, ec}, end; !ec && it != end; it.increment(ec)) {
      auto name = it->path().filename().string();
      if (name.rfind(prefix, 0) != 0) continue;
      char* rest = nullptr;
      auto pid = std::strtol(name.c_str() + std::string{prefix}.size(), &rest, 10);
      if (rest == nullptr || *rest != '-' || pid <= 0) continue;
      bool gone = ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
      std::error_code ignored;
      if (gone || pid == ::getpid()) fs::remove_all(it->path(), ignored);
    }
  }

  void remove_dir() noexcept {
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }

  std::string dir_;
  std::string path_;
};

}  // namespace
