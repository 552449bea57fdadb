// A pool for the nodes of one node-based container (std::set, std::unordered_map): the
// scheduler's indexes erase and insert a node per answer, thousands of producers apart. From
// malloc those nodes end up scattered over the heap, and every answer paid the allocator and a
// cache miss per level (BENCHMARKS.md, "the scheduler alone"); from a pool they sit in a few
// slabs, and the node freed last is the next one given (still in the cache). Memory: the
// container's peak number of nodes (slabs double from 4 to 256 nodes), until the container goes.
// Under AddressSanitizer the pool is std::allocator, so that a use after free of a node is still
// reported.
#pragma once

#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

namespace troupe::detail {

/// One size of block (the size of the first single-object allocation, a container's node),
/// handed out from slabs and kept on a free list; other sizes (a hash table's buckets) go to
/// operator new.
class node_pool {
 public:
  void* take(std::size_t bytes) {
    if (size_ == 0) size_ = round_up(bytes);
    if (round_up(bytes) != size_) return ::operator new(bytes);
    if (free_ != nullptr) {
      auto* p = free_;
      free_ = *static_cast<void**>(p);
      return p;
    }
    if (left_ == 0) {
      // Slabs double from a few nodes: a small container must not hold 256 nodes while
      // thousands of them live (the pool was once each job's table of pieces).
      auto n = slabs_.size() < 6 ? std::size_t{4} << slabs_.size() : max_slab;
      slabs_.push_back(std::make_unique<std::byte[]>(size_ * n));
      next_ = slabs_.back().get();
      left_ = n;
    }
    auto* p = next_;
    next_ += size_;
    --left_;
    return p;
  }

  void give(void* p, std::size_t bytes) noexcept {
    if (size_ == 0 || round_up(bytes) != size_) {
      ::operator delete(p);
      return;
    }
    *static_cast<void**>(p) = free_;
    free_ = p;
  }

 private:
  static constexpr std::size_t max_slab = 256;  ///< nodes
  static std::size_t round_up(std::size_t n) {
    constexpr std::size_t a = alignof(std::max_align_t);
    n = n < sizeof(void*) ? sizeof(void*) : n;
    return (n + a - 1) / a * a;
  }

  std::size_t size_ = 0;
  std::vector<std::unique_ptr<std::byte[]>> slabs_;
  std::byte* next_ = nullptr;
  std::size_t left_ = 0;
  void* free_ = nullptr;
};

#if defined(__SANITIZE_ADDRESS__)
template <class T>
using pool_allocator = std::allocator<T>;
#else
/// A container's allocator on a node_pool of its own (a copy shares it: the container and the
/// rebinds it makes for its nodes and buckets).
template <class T>
class pool_allocator {
 public:
  using value_type = T;
  // A container's nodes belong to its pool: a move or a swap takes the pool along with them; a
  // copy (constructed or assigned) gets nodes of its own, in the pool it has or a new one, so
  // that two containers never share one (a pool is not thread-safe).
  using propagate_on_container_copy_assignment = std::false_type;
  using propagate_on_container_move_assignment = std::true_type;
  using propagate_on_container_swap = std::true_type;
  pool_allocator() : pool_(std::make_shared<node_pool>()) {}
  [[nodiscard]] pool_allocator select_on_container_copy_construction() const {
    return pool_allocator{};
  }
  template <class U>
  pool_allocator(const pool_allocator<U>& other) noexcept : pool_(other.pool_) {}  // NOLINT

  T* allocate(std::size_t n) {
    if (n > static_cast<std::size_t>(-1) / sizeof(T)) throw std::bad_alloc();
    return static_cast<T*>(pool_->take(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept { pool_->give(p, n * sizeof(T)); }

  template <class U>
  bool operator==(const pool_allocator<U>& o) const noexcept {
    return pool_ == o.pool_;
  }
  template <class U>
  bool operator!=(const pool_allocator<U>& o) const noexcept {
    return pool_ != o.pool_;
  }

 private:
  template <class U>
  friend class pool_allocator;
  std::shared_ptr<node_pool> pool_;
};
#endif

}  // namespace troupe::detail
