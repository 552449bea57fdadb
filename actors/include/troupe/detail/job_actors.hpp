// The producer and consumer actors of a job. Each runs on a thread of its own (CAF detached
// actors), so a producer blocked inside work() never stalls another. No exception crosses an
// actor boundary: failures become chunk_result codes or troupe errors.
#pragma once

#include <caf/event_based_actor.hpp>
#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "troupe/bulk.hpp"
#include "troupe/detail/job_core.hpp"
#include "troupe/detail/runtime.hpp"
#include "troupe/device_binding.hpp"
#include "troupe/job.hpp"
#include "troupe/messages.hpp"

namespace troupe::detail {

/// One line describing the exception in flight (LibTorch's backtraces cut off).
std::string describe_current_exception();

template <class Job>
struct producer_state {
  using traits = job_traits<Job>;
  using in = typename traits::input_type;
  using out = typename traits::output_type;

  device where;
  config cfg;
  std::unique_ptr<device_binding> binding;
  std::unique_ptr<typename traits::producer_type> producer;
  std::chrono::steady_clock::time_point last_end{};  ///< when the previous chunk was done

  caf::result<init_done> init() {
    try {
      binding = bind_device(where);
      producer = make_with<typename traits::producer_type>(where, cfg);
      return init_done{where.str()};
    } catch (const device_unavailable& e) {
      return make_error(errc::device_unavailable, e.what());
    } catch (...) {
      binding.reset();
      return make_error(errc::init_error, "producer on " + where.str() +
                                              " failed to start: " + describe_current_exception());
    }
  }

  chunk_result work(const work_chunk& w) {
    chunk_result r;
    r.run = w.run;
    r.first = w.first;
    batch joined;
    try {
      joined = bulk::resolve(w.items);  // a large chunk arrives as fragments and a reference
    } catch (const std::exception& e) {
      r.code = errc::protocol_error;
      r.what = e.what();
      return r;
    }
    auto* items = joined.as<in>();
    if (items == nullptr || !producer) {
      r.code = errc::protocol_error;
      r.what = producer ? "work chunk holds items of another type than the job's input"
                        : "producer on " + where.str() + " was not started or has ended";
      return r;
    }
    auto n = items->items.size();
    std::vector<out> outputs;
    // Numbers are written in place through local pointers (no per-item capacity check);
    // other outputs are appended.
    constexpr bool in_place = raw_items<out> && raw_items<in>;
    if constexpr (in_place)
      outputs.resize(n);
    else
      outputs.reserve(n);
    std::size_t i = 0, k = 0;  // item, output
    auto start = std::chrono::steady_clock::now();
    if (last_end != std::chrono::steady_clock::time_point{})
      r.idle_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(start - last_end).count();
    auto& p = *producer;
    while (i < n) {
      try {
        if constexpr (in_place) {
          const in* x = items->items.data();
          out* o = outputs.data();
          for (; i < n; ++i, ++k) o[k] = p.work(in(x[i]));  // numbers: a copy is free
        } else {
          for (; i < n; ++i, ++k) {
            if constexpr (std::is_rvalue_reference<typename traits::work_arg>::value)
              outputs.push_back(p.work(in(items->items[i])));
            else
              outputs.push_back(p.work(items->items[i]));
          }
        }
        if (binding) binding->synchronize();
      } catch (...) {
        if (!w.keep_going || i >= n) {  // i == n: the device's synchronize() failed
          r.code = errc::work_error;
          r.failed_index = w.first + std::min(i, n - 1);
          r.what = describe_current_exception();
          break;
        }
        // The job skips or retries failed items: note this one and go on with the next.
        r.failures.push_back(item_error{w.first + i, describe_current_exception()});
        ++i;
      }
    }
    if constexpr (in_place) outputs.resize(k);
    last_end = std::chrono::steady_clock::now();
    r.busy_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(last_end - start).count();
    if (r.ok()) r.outputs = batch::of(std::move(outputs));  // without the failed items
    return r;
  }

  caf::result<consume_ack> end() {
    auto p = std::move(producer);
    try {
      if constexpr (has_end<typename traits::producer_type>::value) {
        if (p) p->end();
      }
      delete p.release();  // the destructor runs here, on its own thread, and may throw
      binding.reset();
      return consume_ack{};
    } catch (...) {
      binding.reset();
      return make_error(errc::work_error, "producer::end() on " + where.str() +
                                              " threw: " + describe_current_exception());
    }
  }
};

/// The producer actor of `Job` on device `d`. Spawn it detached.
template <class Job>
caf::behavior producer_actor(caf::event_based_actor* self, device d, config cfg) {
  auto st = std::make_shared<producer_state<Job>>();
  st->where = std::move(d);
  st->cfg = std::move(cfg);
  self->attach_functor([st] {
    try {
      delete st->producer.release();
    } catch (...) {
    }
    st->binding.reset();
  });
  return {
      [st](init_atom) {
        mark_internal_thread();
        return st->init();
      },
      [self, st](const work_chunk& w) {
        mark_internal_thread();
        auto r = st->work(w);
        // Large outputs for a remote scheduler go back as fragments, then a small reference.
        if (r.ok())
          r.outputs =
              bulk::split_for(self, caf::actor_cast<caf::actor>(self->current_sender()), r.outputs);
        return r;
      },
      [](const bulk::fragment&) {},  // joined while it was deserialized
      [st](end_atom) {
        mark_internal_thread();
        return st->end();
      },
  };
}

/// Holds the consumer's result until run() takes it.
template <class R>
using result_slot = std::shared_ptr<std::optional<R>>;

template <class Job>
struct consumer_state {
  using traits = job_traits<Job>;
  using out = typename traits::output_type;
  using result = typename traits::result_type;

  config cfg;
  result_slot<result> slot;
  std::unique_ptr<typename traits::consumer_type> consumer;
  std::string failure;

  caf::error fail(const char* member) {
    failure = std::string{"consumer::"} + member + " threw: " + describe_current_exception();
    dispose();
    return make_error(errc::consumer_error, failure);
  }

  /// Destroys the consumer object (its destructor may throw: ignored, logged by the caller).
  void dispose() noexcept {
    try {
      delete consumer.release();
    } catch (...) {
    }
  }

  caf::result<consume_ack> init() {
    try {
      consumer = make_with<typename traits::consumer_type>(cfg);
      return consume_ack{};
    } catch (...) {
      return fail("consumer (constructor)");
    }
  }

  caf::result<consume_ack> work(consume_chunk& c) {
    if (!consumer) return make_error(errc::consumer_error, failure);
    auto* items = c.items.as<out>();
    if (items == nullptr) return make_error(errc::protocol_error, "output chunk of another type");
    try {
      for (auto&& x : items->items) consumer->work(std::move(x));
      return consume_ack{c.run};
    } catch (...) {
      return fail("work");
    }
  }

  caf::result<consume_ack> end(const end_of_input& e) {
    if (!consumer) return make_error(errc::consumer_error, failure);
    try {
      slot->emplace(consumer->end());
      dispose();
      return consume_ack{e.run};
    } catch (...) {
      return fail("end");
    }
  }
};

/// The consumer actor of one run of `Job`. Spawn it detached.
template <class Job>
caf::behavior consumer_actor(caf::event_based_actor* self, config cfg,
                             result_slot<typename job_traits<Job>::result_type> slot) {
  auto st = std::make_shared<consumer_state<Job>>();
  st->cfg = std::move(cfg);
  st->slot = std::move(slot);
  self->attach_functor([st] { st->dispose(); });
  return {
      [st](init_atom) {
        mark_internal_thread();
        return st->init();
      },
      [st](consume_chunk& c) { return st->work(c); },
      [st](const end_of_input& e) { return st->end(e); },
      // run() is returning: nothing of this consumer may run after it (a high-priority
      // message, ahead of chunks still queued).
      [st](end_atom) {
        if (st->failure.empty()) st->failure = "the run has ended";
        st->dispose();
        return consume_ack{};
      },
  };
}

/// The consumer actor of a stream: hands each chunk of outputs to the reader's bounded buffer
/// (waiting while it is full, which pauses the job's dispatch). Spawn it detached.
inline caf::behavior stream_consumer_actor(caf::event_based_actor*,
                                           std::shared_ptr<stream_buffer> buf) {
  return {
      [](init_atom) {
        mark_internal_thread();
        return consume_ack{};
      },
      [buf](consume_chunk& c) {
        buf->push(std::move(c.items));
        return consume_ack{c.run};
      },
      [](const end_of_input& e) { return consume_ack{e.run}; },
      [buf](end_atom) {
        buf->close();
        return consume_ack{};
      },
  };
}

}  // namespace troupe::detail
