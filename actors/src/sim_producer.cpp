// The simulated producers of troupe::testing::simulation (sim_state.hpp): the job's real
// producer code on each chunk, with the scripted throws; the answer after the chunk's virtual
// cost, held while the node is frozen.
#include "sim_state.hpp"
#include "troupe/detail/job_actors.hpp"

namespace troupe::detail {
namespace {

std::string slot_name(const sim_producer_state& st) {
  return st.where.str() + "#" + std::to_string(st.index);
}

/// The job's real producer code on a chunk, with the scripted throws.
chunk_result run_chunk(sim_producer_state& st, const work_chunk& w) {
  chunk_result r;
  r.run = w.run;
  r.first = w.first;
  auto lent = own_chunk_items(w, r);
  if (!lent) return r;
  batch items = std::move(*lent);
  if (st.serialize) {  // options::serialize: exactly what a node would receive
    try {
      items = round_trip_batch(items, "the chunk's inputs");
    } catch (const std::exception& e) {
      r.code = errc::protocol_error;
      r.what = e.what();
      return r;
    }
  }
  if (!st.ops) {
    r.code = errc::protocol_error;
    r.what = "producer on " + st.where.str() + " was not started or has ended";
    return r;
  }
  std::optional<std::uint64_t> throws;
  if (auto t = st.sim->throws_.find(st.index); t != st.sim->throws_.end())
    for (auto k : t->second)
      if (k >= w.first && k < w.first + items.size() && (!throws || k < *throws)) throws = k;
  auto what = [](std::uint64_t k) {
    return "simulated throw at item " + std::to_string(k) + " (producer_script::throws_at_item)";
  };
  if (throws && !w.keep_going) {
    r.code = errc::work_error;
    r.failed_index = *throws;
    r.what = what(*throws);
    return r;
  }
  auto part = [&](std::size_t from, std::size_t to, work_outcome& out) {
    if (from < to) st.ops->work(items.slice(from, to), w.first + from, w.keep_going, out);
  };
  work_outcome out;
  if (!throws) {
    st.ops->work(items, w.first, w.keep_going, out);
  } else {
    auto at = static_cast<std::size_t>(*throws - w.first);
    work_outcome before, after;
    part(0, at, before);
    part(at + 1, items.size(), after);
    out.wrong_type = before.wrong_type || after.wrong_type;
    out.outputs = before.outputs.concat(after.outputs);
    out.failures = std::move(before.failures);
    out.failures.push_back(item_error{*throws, what(*throws)});
    out.failures.insert(out.failures.end(), after.failures.begin(), after.failures.end());
  }
  if (out.wrong_type) {
    r.code = errc::protocol_error;
    r.what = "work chunk holds items of another type than the job's input";
  } else if (out.failed) {
    r.code = errc::work_error;
    r.failed_index = out.failed_index;
    r.what = std::move(out.what);
  } else {
    r.failures = std::move(out.failures);
    r.outputs = std::move(out.outputs);
    if (st.serialize) {
      try {
        r.outputs = round_trip_batch(r.outputs, "the chunk's outputs");
      } catch (const std::exception& e) {
        r.outputs = {};
        r.code = errc::protocol_error;
        r.what = e.what();
      }
    }
  }
  return r;
}

}  // namespace

caf::behavior sim_producer(caf::event_based_actor* self, std::shared_ptr<sim_producer_state> st) {
  self->attach_functor([st] {
    try {
      if (st->ops) st->ops->destroy();
    } catch (...) {
    }
    st->ops.reset();
  });
  return {
      [st](init_atom) -> caf::result<init_done> {
        if (st->sim->node_of(*st).dead)  // a runner made after its node was lost
          return make_error(errc::node_error, "node " + st->node +
                                                  " is down (killed or lost earlier in this "
                                                  "simulation)");
        try {
          st->ops = st->make(st->where.local(), st->cfg, st->index);
          return init_done{st->where.str()};
        } catch (...) {
          return make_error(errc::init_error,
                            "producer on " + st->where.str() +
                                " failed to start: " + describe_current_exception());
        }
      },
      [self, st](const work_chunk& w) -> caf::result<chunk_result> {
        auto& sim = *st->sim;
        auto range = "job " + std::to_string(w.run) + " items " + std::to_string(w.first) + ".." +
                     std::to_string(w.first + w.items.size());
        if (!sim.chunk_arrived(st->node)) return caf::delegated<chunk_result>{};  // died with it
        sim.record(slot_name(*st) + " got " + range);
        auto r = run_chunk(*st, w);
        auto& n = sim.node_of(*st);
        auto now = sim.clock_now();
        auto cost = std::chrono::duration_cast<std::chrono::nanoseconds>(
            sim.cost_ * static_cast<double>(std::max<std::size_t>(1, w.items.size())) * n.slow *
            sim.draw_jitter());
        auto start = std::max(now, st->busy_until);
        // A frozen node starts it once thawed; a partitioned one works on, its answers held.
        if (n.frozen && n.frozen_until != sim_clock::time_point::max())
          start = std::max(start, n.frozen_until);
        r.idle_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(start - now).count();
        r.busy_ns = cost.count();
        st->busy_until = start + cost;
        auto id = st->next_answer++;
        auto promise = self->make_response_promise<chunk_result>();
        st->answers.emplace(id, std::make_pair(caf::response_promise{promise}, std::move(r)));
        self->delayed_send(self, st->busy_until - now + n.delay, sim_answer_atom::value, id);
        return promise;
      },
      [self, st](sim_answer_atom, std::uint64_t id) {
        auto& sim = *st->sim;
        auto& n = sim.node_of(*st);
        auto i = st->answers.find(id);
        if (i == st->answers.end() || n.dead) return;
        if (n.frozen) {
          n.held.emplace_back(caf::actor_cast<caf::actor>(self), id);
          return;
        }
        auto& [promise, r] = i->second;
        sim.record(slot_name(*st) + " answered job " + std::to_string(r.run) + " items " +
                   std::to_string(r.first) + ".." +
                   std::to_string(r.first + r.outputs.size() + r.failures.size()) +
                   (r.ok() ? std::string{} : " with " + std::string{to_string(r.code)}));
        promise.deliver(std::move(r));
        st->answers.erase(i);
      },
      [st](end_atom) -> caf::result<consume_ack> {
        try {
          if (st->ops) {
            st->ops->end();
            st->ops->destroy();
          }
          st->ops.reset();
          return consume_ack{};
        } catch (...) {
          st->ops.reset();
          return make_error(errc::work_error, "producer::end() on " + st->where.str() +
                                                  " threw: " + describe_current_exception());
        }
      },
  };
}

}  // namespace troupe::detail
