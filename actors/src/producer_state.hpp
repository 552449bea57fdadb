// The state of a producer actor: the job's producer object on its device, and how it runs one
// chunk (a lent range copied first, the wire format with options::serialize, the device
// synchronized, failures as codes). Shared by the real producer actor (job_actors.cpp) and the
// simulated one (sim_producer.cpp), which adds virtual time and scripted faults around it.
#pragma once

#include <algorithm>
#include <caf/actor.hpp>
#include <caf/event_based_actor.hpp>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "run_delay.hpp"
#include "troupe/config.hpp"
#include "troupe/detail/introspect.hpp"
#include "troupe/detail/job_actors.hpp"
#include "troupe/detail/job_ops.hpp"
#include "troupe/detail/runtime.hpp"
#include "troupe/device.hpp"
#include "troupe/device_binding.hpp"
#include "troupe/internal/bulk.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

struct producer_state {
  producer_maker make = nullptr;
  device where;
  config cfg;
  std::size_t index = 0;
  bool serialize = false;  ///< options::serialize
  std::unique_ptr<device_binding> binding;
  std::unique_ptr<producer_ops> producer;
  std::chrono::steady_clock::time_point last_end{};  ///< when the previous chunk was done

  /// What this thread has waited for a CPU so far (ns), where that is not the call's cost: on a
  /// CPU producer. A GPU's work goes on while its thread waits for a CPU (a synchronizing thread
  /// that spins may be preempted): there, 0.
  std::int64_t cpu_waits() const { return where.is_cpu() ? thread_run_delay_ns() : 0; }

  /// Ends a call that began at `start`, when cpu_waits() was `waited`: its time, less what its
  /// thread waited for a CPU since. The chunk sizer learns from it what the producer's items
  /// cost, not how busy the machine was.
  std::int64_t busy_since(std::chrono::steady_clock::time_point start, std::int64_t waited) {
    auto queued = cpu_waits() - waited;
    last_end = std::chrono::steady_clock::now();
    auto wall = std::chrono::duration_cast<std::chrono::nanoseconds>(last_end - start).count();
    return std::max<std::int64_t>(0, wall - std::max<std::int64_t>(0, queued));
  }

  caf::result<init_done> init() {
    try {
      binding = bind_device(where);
      // A CPU producer's LibTorch intra-op threads: a budget of its own, set on its thread
      // before its constructor (docs/api.md, "Thread budgets").
      if (where.is_cpu())
        apply_cpu_thread_budget(
            static_cast<int>(cfg.get_or<std::int64_t>("torch.intra_op_threads", 0)));
      producer = make(where, cfg, index);
      return init_done{where.str()};
    } catch (const device_unavailable& e) {
      return make_error(errc::device_unavailable, e.what());
    } catch (...) {
      binding.reset();
      return make_error(errc::init_error, "producer on " + where.str() +
                                              " failed to start: " + describe_current_exception());
    }
  }

  /// The answer for a chunk of a caller's range whose job's handle took the range back.
  static chunk_result& job_ended(chunk_result& r) {
    r.code = errc::cancelled;
    r.what = "the job has ended";
    return r;
  }

  /// The chunk's items ready for work(): a lent range as it is (the work loop reads it under
  /// its lease, a block at a time: user code never sees the caller's memory, so a producer
  /// stuck in work() cannot hold up the job's handle), fragments joined, and with
  /// options::serialize through the wire format. nullopt when `r` says why not.
  std::optional<batch> prepare(const work_chunk& w, chunk_result& r) {
    r.run = w.run;
    r.first = w.first;
    batch joined = w.items;
    if (joined.lease() && serialize) {
      auto own = joined.owned_slice(0, joined.size());
      if (!own) {
        job_ended(r);
        return std::nullopt;
      }
      joined = std::move(*own);
    }
    if (!joined.lease()) {
      try {
        joined = bulk::resolve(joined);  // a large chunk arrives as fragments and a reference
        if (serialize) joined = round_trip_batch(joined, "the chunk's inputs");
      } catch (const std::exception& e) {
        r.code = errc::protocol_error;
        r.what = e.what();
        return std::nullopt;
      }
    }
    if (!producer) {
      r.code = errc::protocol_error;
      r.what = "producer on " + where.str() + " was not started or has ended";
      return std::nullopt;
    }
    return joined;
  }

  /// `r` from the producer's outcome for a chunk of `n` items (whose work is done, the device
  /// synchronized unless `device_failure` says how that failed).
  void finish(chunk_result& r, work_outcome& out, const work_chunk& w, std::size_t n,
              const std::optional<std::string>& device_failure) {
    r.extra_calls = out.extra_calls;
    if (out.wrong_type) {
      r.code = errc::protocol_error;
      r.what = "work chunk holds items of another type than the job's input";
      return;
    }
    if (out.consumer_failed) {
      r.code = errc::consumer_error;
      r.what = std::move(out.what);
      return;
    }
    if (out.revoked) {  // while this chunk of its caller's range ran
      job_ended(r);
      return;
    }
    if (out.failed) {
      r.code = errc::work_error;
      r.failed_index = out.failed_index;
      r.what = std::move(out.what);
    } else if (device_failure) {  // the device failed the chunk's queued work
      r.code = errc::work_error;
      r.failed_index = w.first + (n > 0 ? n - 1 : 0);
      r.what = *device_failure;
    }
    r.failures = std::move(out.failures);
    if (r.ok()) r.outputs = std::move(out.outputs);  // without the failed items
    if (r.ok() && serialize) {
      try {
        r.outputs = round_trip_batch(r.outputs, "the chunk's outputs");
      } catch (const std::exception& e) {
        r.code = errc::protocol_error;
        r.what = e.what();
      }
    }
  }

  /// The process's work totals (metrics) take one worked chunk of `n` items.
  static void count_worked(const chunk_result& r, std::size_t n) noexcept {
    auto& t = process_work();
    (r.ok() ? t.ok_chunks : t.failed_chunks).fetch_add(1, std::memory_order_relaxed);
    t.items.fetch_add(n, std::memory_order_relaxed);
    t.busy_ns.fetch_add(static_cast<std::uint64_t>(std::max<std::int64_t>(0, r.busy_ns)),
                        std::memory_order_relaxed);
  }

  /// Waits for the device's queued work; the failure's description, if it failed.
  std::optional<std::string> synchronize() {
    if (!binding) return std::nullopt;
    try {
      binding->synchronize();
      return std::nullopt;
    } catch (...) {
      return describe_current_exception();
    }
  }

  chunk_result work(const work_chunk& w) {
    chunk_result r;
    r.tag = w.tag;
    auto joined = prepare(w, r);
    if (!joined) return r;
    auto start = std::chrono::steady_clock::now();
    auto waited = cpu_waits();
    if (last_end != std::chrono::steady_clock::time_point{})
      r.idle_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(start - last_end).count();
    work_outcome out;
    // Folding is for outputs that stay in this process (never with options::serialize, which
    // makes a local run behave as over a network).
    producer->work(*joined, w.first, w.keep_going, serialize ? nullptr : w.fold.get(), out,
                   w.cut.get());
    std::optional<std::string> device_failure;
    if (!out.failed && !out.wrong_type && !out.consumer_failed && !out.revoked)
      device_failure = synchronize();
    r.busy_ns = busy_since(start, waited);
    // With a cut, the items up to where it ends now (the scheduler may have taken the rest).
    auto n = w.cut ? std::min<std::size_t>(joined->size(), w.cut->end()) : joined->size();
    finish(r, out, w, n, device_failure);
    count_worked(r, n);
    return r;
  }

  /// options::batching: consecutive chunks of any jobs in one call of the producer (work_parts),
  /// each answered on its own; its share of the call's time by its items. Parts of a caller's
  /// range (lent) are copied first; folded or serialized chunks go one by one, as without
  /// batching.
  std::vector<chunk_result> work_group(const std::vector<work_chunk>& ws) {
    std::vector<chunk_result> rs(ws.size());
    for (std::size_t i = 0; i < ws.size(); ++i) rs[i].tag = ws[i].tag;
    bool together = !serialize && producer != nullptr;
    for (auto& w : ws) together = together && !w.fold;
    if (!together) {
      for (std::size_t i = 0; i < ws.size(); ++i) rs[i] = work(ws[i]);
      return rs;
    }
    std::vector<batch> joined;
    std::vector<std::size_t> at;  ///< rs index of each joined part
    for (std::size_t i = 0; i < ws.size(); ++i) {
      auto w = ws[i];
      if (w.items.lease()) {
        // A part of a caller's range (run(xs) lends it): copied under its lease to share the
        // call; a range taken back meanwhile ends that part only.
        auto own = w.items.owned_slice(0, w.items.size());
        if (!own) {
          rs[i].run = w.run;
          rs[i].first = w.first;
          job_ended(rs[i]);
          continue;
        }
        w.items = std::move(*own);
      }
      if (auto b = prepare(w, rs[i])) {
        joined.push_back(std::move(*b));
        at.push_back(i);
      }
    }
    if (joined.empty()) return rs;
    std::vector<const batch*> parts;
    std::vector<std::uint64_t> firsts;
    std::vector<bool> keep_going;
    std::size_t total = 0;
    for (std::size_t k = 0; k < joined.size(); ++k) {
      parts.push_back(&joined[k]);
      firsts.push_back(ws[at[k]].first);
      keep_going.push_back(ws[at[k]].keep_going);
      total += joined[k].size();
    }
    auto start = std::chrono::steady_clock::now();
    auto waited = cpu_waits();
    std::int64_t idle = 0;
    if (last_end != std::chrono::steady_clock::time_point{})
      idle = std::chrono::duration_cast<std::chrono::nanoseconds>(start - last_end).count();
    std::vector<work_outcome> outs(parts.size());
    producer->work_parts(parts, firsts, keep_going, outs);
    auto device_failure = synchronize();
    auto busy = busy_since(start, waited);
    for (std::size_t k = 0; k < parts.size(); ++k) {
      auto& r = rs[at[k]];
      r.idle_ns = k == 0 ? idle : 0;
      r.busy_ns = total == 0 ? 0
                             : static_cast<std::int64_t>(static_cast<double>(busy) *
                                                         static_cast<double>(parts[k]->size()) /
                                                         static_cast<double>(total));
      bool worked =
          !outs[k].failed && !outs[k].wrong_type && !outs[k].consumer_failed && !outs[k].revoked;
      finish(r, outs[k], ws[at[k]], parts[k]->size(),
             worked ? device_failure : std::optional<std::string>{});
      count_worked(r, parts[k]->size());
    }
    return rs;
  }

  /// The producer object and the device binding go (the actor is ending); a destructor that
  /// throws is ignored here.
  void destroy() noexcept {
    try {
      if (producer) producer->destroy();
    } catch (...) {
    }
    producer.reset();
    binding.reset();
  }

  caf::result<consume_ack> end() {
    auto p = std::move(producer);
    try {
      if (p) {
        p->end();
        p->destroy();  // the destructor runs here, on its own thread, and may throw
      }
      binding.reset();
      return consume_ack{};
    } catch (...) {
      auto what = describe_current_exception();
      p.reset();  // its destructor still runs with the device bound
      binding.reset();
      return make_error(errc::work_error, "producer::end() on " + where.str() + " threw: " + what);
    }
  }
};

}  // namespace troupe::detail
