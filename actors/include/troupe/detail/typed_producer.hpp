// A job's producer object (job_ops.hpp): producer::work over a chunk's items, one by one or in
// batches, with the job's error policy, folding, lent ranges and the chunk's cut.
#pragma once

#include "troupe/detail/producer_parts.hpp"

namespace troupe::detail {

template <class Job>
class typed_producer final : public producer_ops {
 public:
  using traits = job_traits<Job>;
  using in = typename traits::input_type;
  using out = typename traits::output_type;

  typed_producer(const device& d, const config& cfg, std::size_t index)
      : shared_(shared_state(d, cfg)), p_(make(d, cfg, index, shared_)), cfg_(cfg) {
    using P = typename traits::producer_type;
    // After construction, before the first chunk (this runs in the producer's init): slow first
    // calls (a TorchScript module's profiling runs, allocators) stay out of the chunks' times.
    if constexpr (has_warmup<P>::value) p_->warmup();
  }

  void work(const batch& chunk, std::uint64_t first, bool keep_going, job_gate* fold,
            work_outcome& r, chunk_cut* cut = nullptr) override {
    claims_.start(cut);
    chunk_first_ = first;
    cut_short_ = false;
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
    auto* lease = chunk.lease();  // only ever for numbers: a caller's contiguous range
    if constexpr (traits::folds) {
      if (fold != nullptr && !keep_going) {
        // A folded chunk is cut as any other: items are claimed before they are folded, so
        // that none is both folded here and taken back for an idle producer.
        work_folded(*fold, lease, x, n, first, r);
        return;
      }
    }
    auto outputs = start_outputs(n);
    std::size_t k = 0;  // outputs written
    bool went_on = false;
    if constexpr (raw_items<in>)
      if (lease) went_on = work_on_lent(*lease, x, n, first, keep_going, r, outputs, k);
    if (!lease) went_on = work_on(x, n, first, keep_going, r, outputs, k);
    finish_outputs(went_on, std::move(outputs), k, r);
  }

  void work_parts(const std::vector<const batch*>& parts, const std::vector<std::uint64_t>& firsts,
                  const std::vector<bool>& keep_going, std::vector<work_outcome>& outs) override {
    if constexpr (traits::batched) {
      std::vector<in> all;
      std::vector<std::size_t> sizes;
      bool plain = true;
      for (auto* b : parts) {
        const in* x = nullptr;
        std::size_t n = 0;
        if constexpr (raw_items<in>) {
          if (!b->lease()) std::tie(x, n) = b->template span<in>();
        } else if (auto* items = b->template as<in>()) {
          x = items->items.data();
          n = items->items.size();
        }
        if (b->lease() || (x == nullptr && b->size() != 0)) {
          plain = false;
          break;
        }
        all.insert(all.end(), x, x + n);
        sizes.push_back(n);
      }
      if (plain && !all.empty()) {
        try {
          std::vector<out> ys = p_->work(span<const in>{all.data(), all.size()});
          if (ys.size() == all.size()) {
            std::size_t at = 0;
            for (std::size_t i = 0; i < parts.size(); ++i) {
              auto from = ys.begin() + static_cast<std::ptrdiff_t>(at);
              std::vector<out> mine(
                  std::make_move_iterator(from),
                  std::make_move_iterator(from + static_cast<std::ptrdiff_t>(sizes[i])));
              outs[i].outputs = batch::of(std::move(mine));
              at += sizes[i];
            }
            return;
          }
        } catch (...) {
        }
        // Part by part: only the parts whose items fail alone fail.
        for (std::size_t i = 0; i < parts.size(); ++i) {
          work(*parts[i], firsts[i], keep_going[i], nullptr, outs[i]);
          outs[i].extra_calls += 1;
        }
        return;
      }
    }
    producer_ops::work_parts(parts, firsts, keep_going, outs);
  }

  void end() override {
    if constexpr (has_end<typename traits::producer_type>::value) p_->end();
  }
  void destroy() override { p_.reset(); }

 private:
  // Numbers are written in place through local pointers (no per-item capacity check), into a
  // recycled buffer; other outputs are appended.
  static constexpr bool in_place = raw_items<out> && raw_items<in> && !traits::batched;

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
    // A batch producer's chunk is one call whatever its size (a block per call would pay its
    // fixed cost again every 16 KiB): copied whole.
    constexpr bool whole = traits::batched;
    auto block = whole ? std::max<std::size_t>(n, 1) : lent_block;
    for (std::size_t at = 0; at < n && !cut_short_; at += block) {
      auto m = std::min(block, n - at);
      auto* copy = copy_lent_block(lease, x, at, m, n, r);
      if (copy == nullptr || !work_on(copy, m, first + at, keep_going, r, outputs, k)) return false;
    }
    return true;
  }

  /// Items [at, at + m) of a caller's range of `n` items, copied under its lease into this
  /// producer's block buffer, the next block asked into the cache meanwhile (a prefetch reads
  /// nothing: it never faults, and the lease does not cover it); nullptr (and `r.revoked`) once
  /// the job's handle has taken the range back. Inlined: a call here cost the folded x*x loop
  /// up to 10 % (troupe_ranges_bench).
  __attribute__((always_inline)) const in* copy_lent_block(range_lease& lease, const in* x,
                                                           std::size_t at, std::size_t m,
                                                           std::size_t n, work_outcome& r) {
    if (block_.size() < m) block_.resize(std::max(m, lent_block));
    if (!lease.acquire()) {
      r.revoked = true;
      return nullptr;
    }
    std::memcpy(block_.data(), x + at, m * sizeof(in));
    lease.release();
    auto* next = reinterpret_cast<const char*>(x + at + m);
    for (std::size_t o = 0; o < std::min(m, n - at - m) * sizeof(in); o += 64)
      __builtin_prefetch(next + o);
    return block_.data();
  }

  /// The chunk's outputs into a consumer of the job's own (work_chunk::fold): each output goes
  /// from producer::work straight to that consumer's work(), never stored (a part of a caller's
  /// range is copied first, a block at a time, under its lease). What it hands back is that
  /// consumer (folded_chunk), or the first failure. Nothing once the job's outputs are no longer
  /// wanted (its gate is no longer open: it ended, or consumer::end() began, so this chunk is a
  /// speculative copy that lost) or its handle took the range back; the consumer is then
  /// destroyed here (a throw from its destructor ignored).
  void work_folded(job_gate& gate, range_lease* lease, const in* x, std::size_t n,
                   std::uint64_t first, work_outcome& r) {
    using consumer_type = typename traits::consumer_type;
    if (!gate.open()) {
      r.revoked = true;
      return;
    }
    // Cut before its first item (the scheduler took it all for an idle producer): no consumer
    // is made for it, and its answer (no outputs) is dropped.
    if (n > 0 && claims_.allow(0, 1) == 0) return;
    std::shared_ptr<folded_chunk<consumer_type>> folded;
    try {
      folded = std::make_shared<folded_chunk<consumer_type>>(make_with<consumer_type>(cfg_), n);
    } catch (...) {
      r.consumer_failed = true;
      r.what =
          "consumer::consumer (constructor) threw on a producer folding a chunk for "
          "consumer::merge: " +
          describe_current_exception();
      return;
    }
    auto& part = folded->part();
    constexpr std::size_t block = raw_items<in> ? lent_block : std::size_t{256};
    // The gate before every item; every 64 once items take under 100 ns each (measured over
    // the chunk's first 64 items, then every 16384, one at a time again once they are slower).
    using steady = std::chrono::steady_clock;
    constexpr std::size_t fast_step = 64;
    std::size_t step = 1, done = 0, probe_at = fast_step, probe_from = 0;
    auto probe_start = steady::now();
    for (std::size_t at = 0; at < n; at += block) {
      auto m = std::min(block, n - at);
      const in* src = x + at;
      if constexpr (raw_items<in>) {
        if (lease && (src = copy_lent_block(*lease, x, at, m, n, r)) == nullptr) return;
      }
      for (std::size_t b = 0, k = 0; b < m; b += k) {
        if (!gate.open()) {  // no longer wanted
          r.revoked = true;
          return;
        }
        // The items that may start now (all of them without a cut); none: the scheduler took
        // the rest of the chunk for an idle producer, and it ends here.
        k = claims_.allow(at + b, std::min(step, m - b));
        if (k == 0) {
          folded->cut_to(at + b);
          n = at + b;
          break;
        }
        std::size_t j = 0;
        bool consuming = false;  // which of the two threw
        try {
          fold(part, *p_, src + b, k, j, consuming);
        } catch (...) {
          auto index = first + at + b + j;
          if (consuming) {
            r.consumer_failed = true;
            r.what =
                "consumer::work threw on a producer folding a chunk for consumer::merge "
                "(item " +
                std::to_string(index) + "): " + describe_current_exception();
          } else {
            r.failed = true;
            r.failed_index = index;
            r.what = describe_current_exception();
          }
          return;
        }
        done += k;
        if (done >= probe_at) {
          auto now = steady::now();
          auto items = static_cast<std::int64_t>(done - probe_from);
          bool fast = now - probe_start < std::chrono::nanoseconds{100} * items;
          step = fast ? fast_step : 1;
          probe_start = now;
          probe_from = done;
          probe_at = done + (fast ? 16384 : fast_step);
        }
      }
    }
    if (!gate.open()) {  // not wanted any more: destroyed here, not wherever the answer is dropped
      r.revoked = true;
      return;
    }
    r.outputs = batch{std::move(folded)};
  }

  /// consumer::work(producer::work(x)) for items [x, x + m), counting them in `j`; `consuming`
  /// says whose call was under way when one threw. The items are this producer's own copy
  /// (restrict): a consumer that sums numbers into a member keeps the sum in a register.
  static void fold(typename traits::consumer_type& c, typename traits::producer_type& p,
                   const in* __restrict x, std::size_t m, std::size_t& j, bool& consuming) {
    for (; j < m; ++j) {
      auto y = produce(p, x[j]);
      consuming = true;
      c.work(std::move(y));
      consuming = false;
    }
  }

  /// producer::work on one item, handed over as its parameter takes it (a `&&` parameter gets
  /// a fresh copy to move from).
  static decltype(auto) produce(typename traits::producer_type& p, const in& x) {
    if constexpr (std::is_rvalue_reference<typename traits::work_arg>::value)
      return p.work(in(x));
    else
      return p.work(x);
  }

  /// producer::work on items [x, x + n) (the first one has index `first`), outputs from
  /// outputs[k] on; false when an item failed the chunk.
  bool work_on(const in* x, std::size_t n, std::uint64_t first, bool keep_going, work_outcome& r,
               std::vector<out>& outputs, std::size_t& k) {
    if constexpr (traits::batched) {
      if (n == 0) return true;
      // One call for the items the cut leaves it (all of them unless the scheduler took some).
      auto m = claims_.allow_all(static_cast<std::size_t>(first - chunk_first_), n);
      if (m < n) cut_short_ = true;
      if (m == 0) return true;
      return work_on_batch(x, m, first, keep_going, r, outputs, k);
    } else {
      return work_on_items(x, n, first, keep_going, r, outputs, k);
    }
  }

  bool work_on_items(const in* x, std::size_t n, std::uint64_t first, bool keep_going,
                     work_outcome& r, std::vector<out>& outputs, std::size_t& k) {
    std::size_t i = 0;
    auto& p = *p_;
    auto at = static_cast<std::size_t>(first - chunk_first_);  // x[0]'s index in the chunk
    while (i < n) {
      // The items that may start now (all of them without a cut).
      auto m = claims_.allow(at + i, n - i);
      if (m == 0) {  // the scheduler took the rest of the chunk
        cut_short_ = true;
        return true;
      }
      std::size_t j = 0;  // items done since i
      try {
        if constexpr (in_place) {
          // A counted loop over two local pointers: vectorized where the work allows it.
          const in* src = x + i;
          out* dst = outputs.data() + k;
          for (; j < m; ++j) dst[j] = p.work(in(src[j]));
        } else {
          for (; j < m; ++j) outputs.push_back(produce(p, x[i + j]));
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

  /// A batch producer's work(span) on items [x, x + n): one call; when it throws, the batch is
  /// split in halves and each run again, down to single items, so that only the items that
  /// fail alone fail (each counted in r.extra_calls). False when an item failed the chunk.
  bool work_on_batch(const in* x, std::size_t n, std::uint64_t first, bool keep_going,
                     work_outcome& r, std::vector<out>& outputs, std::size_t& k) {
    std::vector<out> ys;
    try {
      ys = p_->work(span<const in>{x, n});
    } catch (...) {
      if (n > 1) {
        auto half = n / 2;
        r.extra_calls += 1;  // each half's call, counted when it is made
        if (!work_on_batch(x, half, first, keep_going, r, outputs, k)) return false;
        r.extra_calls += 1;
        return work_on_batch(x + half, n - half, first + half, keep_going, r, outputs, k);
      }
      if (!keep_going) {
        r.failed = true;
        r.failed_index = first;
        r.what = describe_current_exception();
        return false;
      }
      r.failures.push_back(item_error{first, describe_current_exception()});
      return true;
    }
    if (ys.size() != n) {  // a bug in the producer: its batch's outputs cannot be matched up
      r.failed = true;
      r.failed_index = first;
      r.what = "producer::work(span) returned " + std::to_string(ys.size()) + " outputs for " +
               std::to_string(n) + " items (it must return one per item, in order)";
      return false;
    }
    for (auto& y : ys) outputs.push_back(std::move(y));
    k += n;
    return true;
  }

  /// Job::device_state of this producer's device (declared first: it outlives the producer
  /// object, and the last producer of the device destroys it).
  std::shared_ptr<device_state_holder<typename traits::device_state_type>> shared_;
  throwing_owner<typename traits::producer_type> p_;
  config cfg_;  ///< for the consumers that fold chunks (work_folded)

  using state_ptr = std::shared_ptr<device_state_holder<typename traits::device_state_type>>;
  static state_ptr shared_state(const device& d, const config& cfg) {
    (void)d;
    (void)cfg;
    if constexpr (traits::shares_state)
      return device_state_for<typename traits::device_state_type>(d, cfg);
    else
      return nullptr;
  }
  static std::unique_ptr<typename traits::producer_type> make(const device& d, const config& cfg,
                                                              std::size_t index,
                                                              const state_ptr& shared) {
    using P = typename traits::producer_type;
    (void)index;
    (void)shared;
    if constexpr (traits::shares_state)
      return std::make_unique<P>(d, cfg, shared->state);
    else
      return make_producer<P>(d, cfg, index);
  }
  /// A caller's range is read this many items at a time (16 KiB: copy_lent_block).
  static constexpr std::size_t lent_block = std::max<std::size_t>(1, 16384 / sizeof(in));
  cut_claims claims_;              ///< the current chunk's cut (work_chunk::cut)
  std::uint64_t chunk_first_ = 0;  ///< the current chunk's first index
  bool cut_short_ = false;         ///< the current chunk ended where the scheduler cut it
  std::vector<in> block_;  ///< copy_lent_block: the block of a caller's range being worked on
  std::shared_ptr<buffer_pool<out>> pool_ = std::make_shared<buffer_pool<out>>();
};

template <class Job>
std::unique_ptr<producer_ops> make_producer_ops(const device& d, const config& cfg,
                                                std::size_t index) {
  return std::make_unique<typed_producer<Job>>(d, cfg, index);
}

}  // namespace troupe::detail
