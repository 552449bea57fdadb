// The per-job code of a runner, behind two small interfaces: a producer's work loop over a
// chunk and a consumer's loop over outputs. Only this part is a template instantiated in the
// user's translation unit; the actors that drive it, the scheduler and the network code are
// compiled once, in the library.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
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
#include "troupe/detail/job_gate.hpp"
#include "troupe/detail/work_outcome.hpp"
#include "troupe/device.hpp"
#include "troupe/error.hpp"
#include "troupe/job.hpp"

namespace troupe::detail {

/// One line describing the exception in flight (LibTorch's backtraces cut off).
std::string describe_current_exception();

/// A job's producer object, constructed on its producer's thread.
class producer_ops {
 public:
  virtual ~producer_ops() = default;
  /// Runs producer::work on every item of `items` (item i has index `first + i`).
  virtual void work(const batch& items, std::uint64_t first, bool keep_going,
                    work_outcome& out) = 0;
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

template <class Job>
class typed_producer final : public producer_ops {
 public:
  using traits = job_traits<Job>;
  using in = typename traits::input_type;
  using out = typename traits::output_type;

  typed_producer(const device& d, const config& cfg, std::size_t index)
      : p_(make_producer<typename traits::producer_type>(d, cfg, index)) {}

  void work(const batch& chunk, std::uint64_t first, bool keep_going, work_outcome& r) override {
    const in* x = nullptr;
    std::size_t n = 0;
    if constexpr (raw_items<in>) {
      std::tie(x, n) = chunk.template span<in>();
    } else if (auto* items = chunk.as<in>()) {
      x = items->items.data();
      n = items->items.size();
    }
    if (x == nullptr && chunk.size() != 0) {
      r.wrong_type = true;
      return;
    }
    auto outputs = start_outputs(n);
    std::size_t k = 0;            // outputs written
    auto* lease = chunk.lease();  // only ever for numbers: a caller's contiguous range
    bool went_on = false;
    if constexpr (raw_items<in>)
      if (lease) went_on = work_on_lent(*lease, x, n, first, keep_going, r, outputs, k);
    if (!lease) went_on = work_on(x, n, first, keep_going, r, outputs, k);
    finish_outputs(went_on, std::move(outputs), k, r);
  }

  void end() override {
    if constexpr (has_end<typename traits::producer_type>::value) p_->end();
  }
  void destroy() override { p_.reset(); }

 private:
  // Numbers are written in place through local pointers (no per-item capacity check), into a
  // recycled buffer; other outputs are appended.
  static constexpr bool in_place = raw_items<out> && raw_items<in>;

  std::vector<out> start_outputs(std::size_t n) {
    std::vector<out> outputs;
    if constexpr (in_place)
      outputs = pool_->take(n);
    else
      outputs.reserve(n);
    return outputs;
  }

  void finish_outputs(bool went_on, std::vector<out> outputs, std::size_t k, work_outcome& r) {
    if (!went_on) return;  // failed or revoked: no outputs
    if constexpr (in_place) {
      outputs.resize(k);
      r.outputs = pool_->wrap(std::move(outputs));  // without the failed items
    } else {
      r.outputs = batch::of(std::move(outputs));
    }
  }

  /// A part of a caller's range: read a block at a time, each copied (under the lease) into a
  /// small buffer of this producer's that stays in the core's cache, work() called on the
  /// copies; so user code never runs while the range is held, the range is read once, and a
  /// job's handle that takes the range back waits for one block's copy at most.
  bool work_on_lent(range_lease& lease, const in* x, std::size_t n, std::uint64_t first,
                    bool keep_going, work_outcome& r, std::vector<out>& outputs, std::size_t& k) {
    constexpr std::size_t block = std::max<std::size_t>(1, 16384 / sizeof(in));
    if (block_.empty()) block_.resize(block);
    for (std::size_t at = 0; at < n; at += block) {
      auto m = std::min(block, n - at);
      if (!lease.acquire()) {
        r.revoked = true;
        return false;
      }
      std::memcpy(block_.data(), x + at, m * sizeof(in));
      lease.release();
      if (!work_on(block_.data(), m, first + at, keep_going, r, outputs, k)) return false;
    }
    return true;
  }

  /// producer::work on items [x, x + n) (the first one has index `first`), outputs from
  /// outputs[k] on; false when an item failed the chunk.
  bool work_on(const in* x, std::size_t n, std::uint64_t first, bool keep_going, work_outcome& r,
               std::vector<out>& outputs, std::size_t& k) {
    std::size_t i = 0;
    auto& p = *p_;
    while (i < n) {
      std::size_t j = 0;  // items done since i
      try {
        if constexpr (in_place) {
          // A counted loop over two local pointers: vectorized where the work allows it.
          const in* src = x + i;
          out* dst = outputs.data() + k;
          for (std::size_t m = n - i; j < m; ++j) dst[j] = p.work(in(src[j]));
        } else {
          for (; i + j < n; ++j) {
            if constexpr (std::is_rvalue_reference<typename traits::work_arg>::value)
              outputs.push_back(p.work(in(x[i + j])));
            else
              outputs.push_back(p.work(x[i + j]));
          }
        }
        i += j;
        k += j;
      } catch (...) {
        i += j;
        k += j;
        if (!keep_going) {
          r.failed = true;
          r.failed_index = first + i;
          r.what = describe_current_exception();
          return false;
        }
        // The job skips or retries failed items: note this one and go on with the next.
        r.failures.push_back(item_error{first + i, describe_current_exception()});
        ++i;
      }
    }
    return true;
  }

  throwing_owner<typename traits::producer_type> p_;
  std::vector<in> block_;  ///< work_on_lent: the block of a caller's range being worked on
  std::shared_ptr<buffer_pool<out>> pool_ = std::make_shared<buffer_pool<out>>();
};

template <class Job>
std::unique_ptr<producer_ops> make_producer_ops(const device& d, const config& cfg,
                                                std::size_t index) {
  return std::make_unique<typed_producer<Job>>(d, cfg, index);
}

/// Registers the job's input and output types for the wire format (options::serialize, probes
/// that serialize). Throws invalid_argument when one of them has no inspect() overload.
template <class Job>
void register_wire_types() {
  using in = typename job_traits<Job>::input_type;
  using out = typename job_traits<Job>::output_type;
  if constexpr (caf::detail::is_serializable<in>::value &&
                caf::detail::is_serializable<out>::value) {
    ensure_batch_type<in>();
    ensure_batch_type<out>();
  } else {
    throw invalid_argument(
        "options::serialize: the job's input or output type cannot be serialized (give it an "
        "inspect() overload); it could not cross a network either");
  }
}

/// Where a job's consumer leaves consumer::end()'s value for job_handle::get().
template <class R>
using result_slot = std::shared_ptr<std::optional<R>>;

template <class Job>
class typed_consumer final : public consumer_ops {
 public:
  using traits = job_traits<Job>;
  using out = typename traits::output_type;

  typed_consumer(const config& cfg, result_slot<typename traits::result_type> slot)
      : c_(make_with<typename traits::consumer_type>(cfg)), slot_(std::move(slot)) {}

  bool work(batch& outputs, job_gate& gate) override {
    auto* items = outputs.as<out>();
    if (items == nullptr) return false;
    std::uint64_t n = 0;
    struct count {  // also when work() throws: what it took before counts as delivered
      job_gate& g;
      std::uint64_t& n;
      ~count() { g.add_delivered(n); }
    } counted{gate, n};
    auto& c = *c_;
    auto& xs = items->items;
    auto size = xs.size();
    // A look at the gate before every item, so that nothing of an ended job runs after the
    // consumer's current item; for a consumer whose previous chunk took under 100 ns per item,
    // before every block of 64 items instead (under ~6 us of them), so that its loop stays tight.
    using steady = std::chrono::steady_clock;
    auto t0 = steady::now();
    std::size_t step = fast_ ? 64 : 1;
    while (n < size && !gate.stopped()) {
      if constexpr (std::is_same<out, bool>::value) {  // std::vector<bool>: no data()
        for (auto stop = std::min(size, n + step); n < stop; ++n) c.work(bool(xs[n]));
      } else {
        take(c, xs.data() + n, std::min(step, size - n), n);
      }
    }
    if (size >= 64)
      fast_ = steady::now() - t0 < std::chrono::nanoseconds{100} * static_cast<std::int64_t>(size);
    return true;
  }
  void end() override { slot_->emplace(c_->end()); }
  void destroy() override { c_.reset(); }

 private:
  /// consumer::work on outputs [xs, xs + m), counted into `taken` (also when one throws). The
  /// outputs are this batch's own (restrict): a consumer that sums numbers into a member keeps
  /// the sum in a register and the loop is vectorized.
  static void take(typename traits::consumer_type& c, out* __restrict xs, std::size_t m,
                   std::uint64_t& taken) {
    std::size_t j = 0;
    try {
      for (; j < m; ++j) c.work(std::move(xs[j]));
    } catch (...) {
      taken += j;
      throw;
    }
    taken += j;
  }

  throwing_owner<typename traits::consumer_type> c_;
  result_slot<typename traits::result_type> slot_;
  bool fast_ = false;  ///< the last chunk of 64 items or more took under 100 ns per item
};

template <class Job>
consumer_maker make_consumer_maker(result_slot<typename job_traits<Job>::result_type> slot) {
  return [slot = std::move(slot)](const config& cfg) -> std::unique_ptr<consumer_ops> {
    return std::make_unique<typed_consumer<Job>>(cfg, slot);
  };
}

}  // namespace troupe::detail
