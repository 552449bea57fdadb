// The state of a producer actor: the job's producer object on its device, and how it runs one
// chunk (a lent range copied first, the wire format with options::serialize, the device
// synchronized, failures as codes). Shared by the real producer actor (job_actors.cpp) and the
// simulated one (sim_producer.cpp), which adds virtual time and scripted faults around it.
#pragma once

#include <caf/actor.hpp>
#include <caf/event_based_actor.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "troupe/config.hpp"
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

  caf::result<init_done> init() {
    try {
      binding = bind_device(where);
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

  chunk_result work(const work_chunk& w) {
    chunk_result r;
    r.run = w.run;
    r.first = w.first;
    // A part of a caller's range, lent (batch_view): the work loop reads it a block at a time
    // under its lease (user code never sees the caller's memory, so a producer stuck in
    // work() cannot hold up the job's handle). With options::serialize it is copied here first,
    // to go through the wire format.
    batch joined = w.items;
    if (joined.lease() && serialize) {
      auto own = joined.owned_slice(0, joined.size());
      if (!own) return job_ended(r);
      joined = std::move(*own);
    }
    if (!joined.lease()) {
      try {
        joined = bulk::resolve(joined);  // a large chunk arrives as fragments and a reference
        if (serialize) joined = round_trip_batch(joined, "the chunk's inputs");
      } catch (const std::exception& e) {
        r.code = errc::protocol_error;
        r.what = e.what();
        return r;
      }
    }
    if (!producer) {
      r.code = errc::protocol_error;
      r.what = "producer on " + where.str() + " was not started or has ended";
      return r;
    }
    auto start = std::chrono::steady_clock::now();
    if (last_end != std::chrono::steady_clock::time_point{})
      r.idle_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(start - last_end).count();
    work_outcome out;
    // Folding is for outputs that stay in this process (never with options::serialize, which
    // makes a local run behave as over a network).
    producer->work(joined, w.first, w.keep_going, serialize ? nullptr : w.fold.get(), out);
    r.extra_calls = out.extra_calls;
    if (out.wrong_type) {
      r.code = errc::protocol_error;
      r.what = "work chunk holds items of another type than the job's input";
      return r;
    }
    if (out.consumer_failed) {
      r.code = errc::consumer_error;
      r.what = std::move(out.what);
      return r;
    }
    if (out.revoked) return job_ended(r);  // while this chunk of its caller's range ran
    if (out.failed) {
      r.code = errc::work_error;
      r.failed_index = out.failed_index;
      r.what = std::move(out.what);
    } else if (binding) {
      try {
        binding->synchronize();
      } catch (...) {  // the device failed the chunk's queued work
        r.code = errc::work_error;
        r.failed_index = w.first + (joined.size() > 0 ? joined.size() - 1 : 0);
        r.what = describe_current_exception();
      }
    }
    last_end = std::chrono::steady_clock::now();
    r.busy_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(last_end - start).count();
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
    return r;
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
