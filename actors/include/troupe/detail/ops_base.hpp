// The two small interfaces behind which a runner keeps its per-job code (job_ops.hpp): a
// producer's work loop over a chunk and a consumer's loop over outputs; and what their typed
// versions share: owners of objects whose destructor may throw, output buffers taken again,
// a chunk's outputs folded on its producer.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "troupe/batch.hpp"
#include "troupe/config.hpp"
#include "troupe/detail/chunk_cut.hpp"
#include "troupe/detail/job_gate.hpp"
#include "troupe/detail/work_outcome.hpp"
#include "troupe/device.hpp"
#include "troupe/error.hpp"
#include "troupe/job.hpp"
#include "troupe/span.hpp"

namespace troupe::detail {

/// One line describing the exception in flight (LibTorch's backtraces cut off).
std::string describe_current_exception();

/// A job's producer object, constructed on its producer's thread.
class producer_ops {
 public:
  virtual ~producer_ops() = default;
  /// Runs producer::work on every item of `items` (item i has index `first + i`). `fold`
  /// (work_chunk::fold, never with keep_going): the outputs go into a consumer of the job's
  /// own, made for this chunk, handed back as a folded_chunk for the job's consumer to merge.
  /// `cut` (work_chunk::cut, or null): items are claimed there before they start, and the
  /// chunk ends where the scheduler cut it (the outcome then covers items [0, cut->end())).
  virtual void work(const batch& items, std::uint64_t first, bool keep_going, job_gate* fold,
                    work_outcome& out, chunk_cut* cut = nullptr) = 0;
  /// options::batching: the chunks `parts` (of any jobs, none lent or folded) in one call where
  /// the job's producer takes a batch (work(span)): their items concatenated, each part's
  /// outcome in outs[i]. A call that throws (or returns another number of outputs) is made
  /// again part by part, each as work() would (split down to the items that fail alone), so
  /// only the parts with such items fail; every call beyond the first is counted in
  /// extra_calls. Other producers: each part through work().
  virtual void work_parts(const std::vector<const batch*>& parts,
                          const std::vector<std::uint64_t>& firsts,
                          const std::vector<bool>& keep_going, std::vector<work_outcome>& outs) {
    for (std::size_t i = 0; i < parts.size(); ++i)
      work(*parts[i], firsts[i], keep_going[i], nullptr, outs[i]);
  }
  /// producer::end(), if the job has one.
  virtual void end() = 0;
  /// Destroys the job's producer object; its destructor may throw (and that is reported).
  virtual void destroy() = 0;
};

/// A job's consumer object for one job, constructed on the consumer's thread.
class consumer_ops {
 public:
  virtual ~consumer_ops() = default;
  /// consumer::work on every output, before each one checking that the job has not ended
  /// (`gate.stopped()`: the rest of the chunk is given up) and counting it in
  /// `gate.add_delivered()`; returns false when the batch holds another type.
  virtual bool work(batch& outputs, job_gate& gate) = 0;
  /// consumer::end(): its value is kept for job_handle::get().
  virtual void end() = 0;
  /// The consumer member work() was calling when it threw: "work", or "merge".
  [[nodiscard]] virtual const char* member() const noexcept { return "work"; }
  /// Destroys the job's consumer object; its destructor may throw.
  virtual void destroy() = 0;
};

/// Owns a job's producer or consumer object, whose destructor may throw: reset() lets that
/// through (to be reported); the owner's own destructor swallows it.
template <class T>
class throwing_owner {
 public:
  explicit throwing_owner(std::unique_ptr<T> p) : p_(p.release()) {}
  throwing_owner(const throwing_owner&) = delete;
  throwing_owner& operator=(const throwing_owner&) = delete;
  ~throwing_owner() {
    try {
      reset();
    } catch (...) {
    }
  }
  void reset() { delete std::exchange(p_, nullptr); }
  T& operator*() const noexcept { return *p_; }
  T* operator->() const noexcept { return p_; }

 private:
  T* p_;
};

/// Constructs a job's producer object on `d` (index: its position in the runner's devices).
using producer_maker = std::unique_ptr<producer_ops> (*)(const device& d, const config& cfg,
                                                         std::size_t index);
/// Constructs a job's consumer object.
using consumer_maker = std::function<std::unique_ptr<consumer_ops>(const config& cfg)>;

/// Output buffers of numbers, given back when the batch holding them is destroyed (by the
/// consumer, or once sent to a node) and taken again for the next chunk: no fresh pages to
/// fault in and no zero-fill for every chunk. Keeps a few buffers at most.
template <class T>
class buffer_pool : public std::enable_shared_from_this<buffer_pool<T>> {
 public:
  /// A buffer of at least `n` items (their values are whatever was there).
  std::vector<T> take(std::size_t n) {
    std::vector<T> v;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (!free_.empty()) {
        v = std::move(free_.back());
        free_.pop_back();
      }
    }
    v.resize(n);  // a smaller size: no fill; a larger one: only the growth is filled
    return v;
  }
  /// `items` as a batch that gives its buffer back here when it is destroyed.
  batch wrap(std::vector<T> items) {
    auto self = this->shared_from_this();
    return batch{
        std::shared_ptr<batch_base>(new batch_of<T>(std::move(items)), [self](batch_base* b) {
          auto* typed = static_cast<batch_of<T>*>(b);
          self->give(std::move(typed->items));
          delete typed;
        })};
  }

 private:
  void give(std::vector<T> v) noexcept {
    try {
      std::lock_guard<std::mutex> guard{mtx_};
      if (free_.size() < max_free) free_.push_back(std::move(v));
    } catch (...) {
    }
  }
  static constexpr std::size_t max_free = 4;
  std::mutex mtx_;
  std::vector<std::vector<T>> free_;
};

/// consumer::work on outputs [xs, xs + m), counted into `taken` (also when one throws).
template <class C, class Out>
void take(C& c, Out* __restrict xs, std::size_t m, std::size_t& taken) {
  std::size_t j = 0;
  try {
    for (; j < m; ++j) c.work(std::move(xs[j]));
  } catch (...) {
    taken += j;
    throw;
  }
  taken += j;
}

/// consumer::work on outputs [xs, xs + size), counted into `taken` (also when one throws).
/// Looks at the job's gate before every item, so that nothing of an ended job runs after the
/// consumer's current item; for a consumer whose previous run took under 100 ns per item
/// (`fast`, updated here), before every block of 64 items instead (under ~6 us of them), so
/// that its loop stays tight. The outputs are the caller's own (restrict): a consumer that sums
/// numbers into a member keeps the sum in a register and the loop is vectorized.
template <class C, class Out>
void consume_checked(C& c, Out* xs, std::size_t size, const job_gate& gate, bool& fast,
                     std::uint64_t& taken) {
  using steady = std::chrono::steady_clock;
  auto t0 = steady::now();
  std::size_t step = fast ? 64 : 1;
  std::size_t n = 0;
  struct count {  // also when work() throws: what it took before counts
    std::uint64_t& taken;
    std::size_t& n;
    ~count() { taken += n; }
  } counted{taken, n};
  while (n < size && !gate.stopped()) take(c, xs + n, std::min(step, size - n), n);
  if (size >= 64)
    fast = steady::now() - t0 < std::chrono::nanoseconds{100} * static_cast<std::int64_t>(size);
}

/// A chunk's outputs folded on its producer (work_chunk::fold): a consumer of the job's own
/// that took them, for the job's consumer to merge(). Never crosses the network.
template <class C>
class folded_chunk final : public batch_base {
 public:
  folded_chunk(std::unique_ptr<C> part, std::size_t n) : part_(std::move(part)), n_(n) {}
  /// The consumer that took the chunk's outputs (merged once, by the job's consumer).
  [[nodiscard]] C& part() const noexcept { return *part_; }
  /// Destroys that consumer now (once merged); a throw from its destructor is ignored.
  void dispose() const noexcept {
    try {
      part_.reset();
    } catch (...) {
    }
  }
  [[nodiscard]] std::size_t size() const noexcept override { return n_; }
  /// The chunk was cut short (chunk_cut): it holds the outputs of its first `n` items only.
  void cut_to(std::size_t n) noexcept { n_ = n; }
  [[nodiscard]] const std::type_info& item_type() const noexcept override {
    return typeid(folded_chunk<C>);
  }
  [[nodiscard]] std::optional<std::size_t> flat_bytes() const noexcept override {
    return sizeof(C);
  }
  caf::error save(caf::serializer&) const override {
    return caf::make_error(caf::sec::state_not_serializable);
  }
  caf::error load(caf::deserializer&) override {
    return caf::make_error(caf::sec::state_not_serializable);
  }
  [[nodiscard]] std::shared_ptr<batch_base> slice(std::size_t, std::size_t) const override {
    throw std::logic_error("a folded chunk's outputs cannot be sliced");
  }

 private:
  mutable throwing_owner<C> part_;  ///< its destructor may throw: ignored
  std::size_t n_;
};

}  // namespace troupe::detail
