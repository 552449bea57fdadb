// serve's model file, read once (examples/serve.cpp): a copy of it, and of its FILE.ref.txt, in
// a private directory, which every later load reads. The reference check, each device's copy of
// the weights and the self-test's scores all load the model: from the file itself, one rewritten
// while serve starts would be checked in one version and served in another.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

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
  /// /tmp). A file that changes while it is copied is copied again (up to 5 times, 100 ms apart);
  /// throws when it kept changing or cannot be read.
  explicit model_snapshot(const std::string& file) {
    namespace fs = std::filesystem;
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        std::string{tmp != nullptr && *tmp != '\0' ? tmp : "/tmp"} + "/troupe-serve-XXXXXX";
    std::vector<char> name(pattern.begin(), pattern.end());
    name.push_back('\0');
    if (::mkdtemp(name.data()) == nullptr)
      throw std::runtime_error("serve: cannot make a directory for the model's copy (" + pattern +
                               "): " + std::generic_category().message(errno));
    dir_ = name.data();
    try {
      path_ = dir_ + "/" + fs::path{file}.filename().string();
      copy_whole(file, path_);
      if (fs::exists(file + ".ref.txt")) copy_whole(file + ".ref.txt", path_ + ".ref.txt");
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
    return {st.st_dev, st.st_ino, st.st_size, st.st_mtim};
  }

  static void copy_whole(const std::string& from, const std::string& to) {
    namespace fs = std::filesystem;
    for (int attempt = 0; attempt < 5; ++attempt) {
      if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds{100});
      auto before = version_of(from);
      std::error_code ec;
      fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
      if (ec) throw std::runtime_error(from + ": " + ec.message());
      if (version_of(from) == before) return;
    }
    throw std::runtime_error(from +
                             " kept changing while serve read it: write the model "
                             "elsewhere and move it into place");
  }

  void remove_dir() noexcept {
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }

  std::string dir_;
  std::string path_;
};

}  // namespace
