#include "troupe/detail/job_actors.hpp"

#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>
#include <chrono>
#include <deque>
#include <exception>
#include <string>
#include <utility>

#include "producer_state.hpp"
#include "troupe/detail/job_core.hpp"
#include "troupe/detail/runtime.hpp"
#include "troupe/device_binding.hpp"
#include "troupe/internal/bulk.hpp"
#include "troupe/internal/registry.hpp"
#include "troupe/internal/remote_cuts.hpp"
#include "troupe/protocol.hpp"
#include "troupe/register.hpp"

namespace troupe::detail {

std::string describe_current_exception() {
  try {
    throw;
  } catch (const std::exception& e) {
    std::string what = e.what();
    // LibTorch appends a backtrace ("Exception raised from ..."): keep the first part.
    if (auto cut = what.find("\nException raised from"); cut != std::string::npos) what.resize(cut);
    return what;
  } catch (...) {
    return "an exception of a type not derived from std::exception";
  }
}

namespace {

/// options::batching: the parts of a group received so far, each with its answer to come.
struct chunk_group {
  std::vector<work_chunk> parts;
  std::vector<caf::response_promise> answers;
};

/// A chunk from a coordinator in another process that may be trimmed (options::
/// split_late_chunks): its end is kept in remote_cuts, where the node's actor moves it (this
/// actor's mailbox is busy until the chunk is done); the answer says where it ended.
chunk_result work_trimmable(caf::event_based_actor* self, producer_state& st, const work_chunk& w) {
  auto mine = w;
  mine.cut = remote_cuts::start(self->id(), w.cut_id, w.items.size());
  auto r = st.work(mine);
  auto end = mine.cut->end();
  remote_cuts::finish(self->id(), w.cut_id);
  if (end < w.items.size()) r.kept = static_cast<std::int64_t>(end);
  return r;
}

caf::behavior producer_actor(caf::event_based_actor* self, std::shared_ptr<producer_state> st) {
  self->attach_functor([st, id = self->id()] {
    st->destroy();
    remote_cuts::forget(id);
  });
  auto group = std::make_shared<chunk_group>();
  return {
      [st](init_atom) {
        mark_internal_thread();
        return st->init();
      },
      [self, st, group](const work_chunk& w) -> caf::result<chunk_result> {
        mark_internal_thread();
        if (w.group_size > 1) {
          // The scheduler sends a group's parts back to back (CAF keeps their order): one
          // call of the producer once the last one is here, then an answer for each.
          if (w.group_pos != group->parts.size()) {  // cannot happen: each part on its own
            for (std::size_t i = 0; i < group->parts.size(); ++i)
              group->answers[i].deliver(st->work(group->parts[i]));
            group->parts.clear();
            group->answers.clear();
            if (w.group_pos != 0) return st->work(w);
          }
          group->parts.push_back(w);
          group->answers.push_back(self->make_response_promise());
          auto answer = group->answers.back();
          if (group->parts.size() == w.group_size) {
            auto rs = st->work_group(group->parts);
            auto answers = std::move(group->answers);
            group->parts.clear();
            group->answers.clear();
            for (std::size_t i = 0; i < rs.size(); ++i) answers[i].deliver(std::move(rs[i]));
          }
          return answer;
        }
        auto r = w.cut_id != 0 && !w.cut ? work_trimmable(self, *st, w) : st->work(w);
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

struct consumer_state {
  consumer_maker make;
  config cfg;
  std::shared_ptr<job_gate> gate;
  std::unique_ptr<consumer_ops> consumer;
  bool started = false;  ///< the constructor ran (or threw)
  std::string failure;

  caf::error fail(const char* member) {
    failure = std::string{"consumer::"} + member + " threw: " + describe_current_exception();
    dispose();
    return make_error(errc::consumer_error, failure);
  }

  /// Destroys the consumer object (its destructor may throw: ignored).
  void dispose() noexcept {
    try {
      if (consumer) consumer->destroy();
    } catch (...) {
    }
    consumer.reset();
  }

  /// Constructs the consumer object on the first message (init_atom, or a job's first chunk).
  caf::error start() {
    if (started) return {};
    started = true;
    if (gate->stopped()) {  // the job ended before its consumer ran at all
      failure = "the job has ended";
      return make_error(errc::consumer_error, failure);
    }
    try {
      consumer = make(cfg);
      return {};
    } catch (...) {
      return fail("consumer (constructor)");
    }
  }

  caf::result<consume_ack> init() {
    if (auto err = start()) return err;
    return consume_ack{};
  }

  /// consumer::work on a chunk's outputs, then consumer::end() after the job's last chunk.
  caf::error work(consume_chunk& c) {
    if (auto err = start()) return err;
    if (!consumer) return make_error(errc::consumer_error, failure);
    try {
      if (!consumer->work(c.items, *gate))
        return make_error(errc::protocol_error, "output chunk of another type");
    } catch (...) {
      return fail(consumer->member());
    }
    if (!c.last) return {};
    if (auto err = finish()) return err;
    if (gate->succeeded) gate->succeeded();  // the caller need not wait for the scheduler
    return {};
  }

  caf::result<consume_ack> end(std::uint64_t run) {
    if (auto err = finish()) return err;
    return consume_ack{run};
  }

  /// consumer::end().
  caf::error finish() {
    if (auto err = start()) return err;
    if (!consumer) return make_error(errc::consumer_error, failure);
    // A cancel or deadline that came first wins: end() does not start. Once it has started,
    // its value is the job's result.
    if (!gate->begin_end()) {
      failure = "the job has ended";
      dispose();
      return make_error(errc::consumer_error, failure);
    }
    try {
      consumer->end();
      dispose();
      return {};
    } catch (...) {
      return fail("end");
    }
  }
};

/// The answer to a chunk the consumer has taken: counted in the job's gate and, for the
/// scheduler's plain messages, sent only when the scheduler waits for it or for the job's last
/// chunk (job_gate::chunk_done); a request (a troupe::testing probe's) is always answered.
caf::result<consume_ack> taken(job_gate& gate, bool request, std::uint64_t run, bool last) {
  if (gate.chunk_done() || last || request) return consume_ack{run};
  return caf::delegated<consume_ack>{};
}

// Consumers are event-based actors on the actor system's shared threads: a job costs no thread
// of its own, and nothing once it has ended. An actor handles one message at a time, so the
// job's consumer still sees its outputs one chunk after the other, in the scheduler's order.
caf::behavior consumer_actor(caf::event_based_actor* self, std::shared_ptr<consumer_state> st) {
  self->attach_functor([st] { st->dispose(); });
  return {
      [st](init_atom) {
        mark_internal_thread();
        return st->init();
      },
      // After consumer::end() nothing is left to do: the actor ends itself
      // once it has answered, and nobody needs to end it.
      [self, st](consume_chunk& c) -> caf::result<consume_ack> {
        mark_internal_thread();
        bool request = self->current_message_id().is_request();
        auto err = st->work(c);
        if (c.last) self->quit();
        if (err) return err;
        return taken(*st->gate, request, c.run, c.last);
      },
      [self, st](const end_of_input& e) {
        mark_internal_thread();
        auto r = st->end(e.run);
        self->quit();
        return r;
      },
      // The job is returning: nothing of this consumer may run after it (a high-priority
      // message, ahead of chunks still queued).
      [self, st](end_atom) {
        if (st->failure.empty()) st->failure = "the run has ended";
        st->dispose();
        self->quit();
      },
  };
}

struct stream_state {
  std::shared_ptr<stream_buffer> buf;
  std::shared_ptr<job_gate> gate;
  struct held_chunk {
    caf::response_promise promise;
    std::uint64_t run = 0;
  };
  std::deque<held_chunk> held;  ///< acknowledgements held back while it is full
};

// Never blocks: a chunk beyond the buffer's capacity is kept, and its acknowledgement waits
// until the reader makes room, so the scheduler's consumer_backlog bounds what is queued.
caf::behavior stream_consumer_actor(caf::event_based_actor* self,
                                    std::shared_ptr<stream_state> st) {
  caf::actor_addr me = self->address();  // weak: the buffer must not keep this actor alive
  st->buf->on_room([me] {
    if (auto a = caf::actor_cast<caf::actor>(me)) caf::anon_send(a, room_atom::value);
  });
  return {
      [](init_atom) { return consume_ack{}; },
      [self, st](consume_chunk& c) -> caf::result<consume_ack> {
        bool request = self->current_message_id().is_request();
        auto n = c.items.size();
        if (st->gate->stopped()) return taken(*st->gate, request, c.run, c.last);
        bool room = st->buf->push(std::move(c.items));
        st->gate->add_delivered(n);
        if (room && st->held.empty()) return taken(*st->gate, request, c.run, c.last);
        // Taken once the reader makes room: answered then, whatever the scheduler waits for.
        // Behind a chunk held already, it waits too (taken in order): a room message is on its
        // way, or the buffer calls on_room at the next pop that makes room.
        st->held.push_back({self->make_response_promise(), c.run});
        return st->held.back().promise;
      },
      // The reader made room, but a chunk that came before this message may have filled the
      // buffer again: room_or_wait() then asks for the next room message.
      [st](room_atom) {
        while (!st->held.empty() && st->buf->room_or_wait()) {
          auto& h = st->held.front();
          st->gate->chunk_done();
          h.promise.deliver(consume_ack{h.run});
          st->held.pop_front();
        }
      },
      [](const end_of_input& e) { return consume_ack{e.run}; },
      [self, st](end_atom) {
        st->buf->close();
        st->held.clear();
        self->quit();
      },
  };
}

}  // namespace

caf::actor spawn_producer_actor(caf::actor_system& sys, producer_maker make, device d, config cfg,
                                std::size_t index, bool serialize) {
  auto st = std::make_shared<producer_state>();
  st->serialize = serialize;
  st->make = make;
  st->where = std::move(d);
  st->cfg = std::move(cfg);
  st->index = index;
  bool cpu = st->where.is_cpu();
  auto a = sys.spawn<caf::detached>(producer_actor, std::move(st));
  if (cpu) {  // counted before any producer starts: their intra-op budgets divide the cores
    count_cpu_producer(1);
    a->attach_functor([] { count_cpu_producer(-1); });
  }
  return a;
}

caf::actor spawn_consumer_actor(caf::actor_system& sys, consumer_maker make, config cfg,
                                std::shared_ptr<job_gate> gate) {
  auto st = std::make_shared<consumer_state>();
  st->make = std::move(make);
  st->cfg = std::move(cfg);
  st->gate = gate ? std::move(gate) : std::make_shared<job_gate>();
  return sys.spawn<caf::lazy_init>(consumer_actor, std::move(st));
}

caf::actor spawn_stream_consumer(caf::actor_system& sys, std::shared_ptr<stream_buffer> buf,
                                 std::shared_ptr<job_gate> gate) {
  auto st = std::make_shared<stream_state>();
  st->buf = std::move(buf);
  st->gate = std::move(gate);
  return sys.spawn<caf::lazy_init>(stream_consumer_actor, std::move(st));
}

}  // namespace troupe::detail

namespace troupe::detail {

bool register_job_ops(const std::string& name, const std::type_info& job, producer_maker make,
                      std::string signature) {
  return register_job(
      name, job,
      [make](caf::actor_system& sys, const device& d, const config& cfg, std::size_t index) {
        return spawn_producer_actor(sys, make, d, cfg, index);
      },
      std::move(signature));
}

std::string registered_job_name(const std::type_info& job) {
  return job_name(job);
}

}  // namespace troupe::detail
