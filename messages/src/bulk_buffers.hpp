// bulk.cpp's join buffers (anonymous mappings, recycled) and the padding before blocks, shared
// with the reader (bulk_reader.cpp).
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "troupe/internal/bulk.hpp"

namespace troupe::bulk {
namespace pages {

// -- join buffers: anonymous mappings (pages are only backed once written), recycled so that a
// steady stream of large payloads does not pay page faults for every one of them ---------------

constexpr std::size_t huge_page = std::size_t{2} << 20;
constexpr std::size_t pool_bytes = std::size_t{512} << 20;  // kept for reuse, at most
constexpr std::size_t pool_count = 8;

struct mapping {
  char* data = nullptr;
  std::size_t size = 0;
};

class buffer_pool {
 public:
  mapping acquire(std::size_t n) {
    std::size_t want = (std::max<std::size_t>(n, 1) + huge_page - 1) / huge_page * huge_page;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      auto best = free_.end();
      for (auto i = free_.begin(); i != free_.end(); ++i)
        if (i->size >= want && i->size <= 2 * want && (best == free_.end() || i->size < best->size))
          best = i;
      if (best != free_.end()) {
        auto m = *best;
        free_.erase(best);
        kept_ -= m.size;
        return m;
      }
    }
    void* p = mmap(nullptr, want, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return {};
#ifdef MADV_HUGEPAGE
    madvise(p, want, MADV_HUGEPAGE);  // fewer page faults when the machine allows it
#endif
    return {static_cast<char*>(p), want};
  }

  void release(mapping m) {
    if (m.data == nullptr) return;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (kept_ + m.size <= pool_bytes && free_.size() < pool_count) {
        free_.push_back(m);
        kept_ += m.size;
        return;
      }
    }
    munmap(m.data, m.size);
  }

 private:
  std::mutex mtx_;
  std::vector<mapping> free_;
  std::size_t kept_ = 0;
};

inline buffer_pool& pool() {
  static auto* instance = new buffer_pool;  // never destroyed: buffers may outlive statics
  return *instance;
}

inline std::size_t padding(std::uint64_t pos) {
  return static_cast<std::size_t>((alignment - pos % alignment) % alignment);
}

}  // namespace pages

struct reader::buffer {
  pages::mapping mem;
  std::uint64_t size = 0;
  explicit buffer(std::uint64_t n) : mem(pages::pool().acquire(n)), size(n) {}
  ~buffer() { pages::pool().release(mem); }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
};

}  // namespace troupe::bulk
