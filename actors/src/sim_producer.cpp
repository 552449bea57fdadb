// The simulated producers of troupe::testing::simulation (sim_state.hpp): the job's real
// producer code on each chunk, run as a real producer actor runs it (producer_state), with the
// scripted throws around it; the answer after the chunk's virtual cost, held while the node is
// frozen.
#include "sim_state.hpp"

namespace troupe::detail {
namespace {

std::string slot_name(const sim_producer_state& st) {
  return st.where.str() + "#" + std::to_string(st.real.index);
}

/// The job's producer with producer_script::throws_at_item: the scripted item throws (each time
/// this producer runs it); the others run the job's own code.
class scripted_ops final : public producer_ops {
 public:
  scripted_ops(std::unique_ptr<producer_ops> inner, const sim_state& sim, std::size_t index)
      : inner_(std::move(inner)), sim_(sim), index_(index) {}

  void work(const batch& items, std::uint64_t first, bool keep_going, job_gate* fold,
            work_outcome& out, chunk_cut* cut = nullptr) override {
    auto k = scripted_throw(first, items.size());
    if (!k) {
      inner_->work(items, first, keep_going, fold, out, cut);
      return;
    }
    auto what =
        "simulated throw at item " + std::to_string(*k) + " (producer_script::throws_at_item)";
    if (!keep_going) {
      out.failed = true;
      out.failed_index = *k;
      out.what = std::move(what);
      return;
    }
    // The outputs around it, as a producer that goes on after a throw gives them (a part of a
    // caller's range copied first, under its lease).
    auto own = items.owned_slice(0, items.size());
    if (!own) {
      out.revoked = true;
      return;
    }
    auto at = static_cast<std::size_t>(*k - first);
    work_outcome before, after;
    if (at > 0) inner_->work(own->slice(0, at), first, true, nullptr, before);
    if (at + 1 < own->size())
      inner_->work(own->slice(at + 1, own->size()), *k + 1, true, nullptr, after);
    out.wrong_type = before.wrong_type || after.wrong_type;
    out.outputs = before.outputs.concat(after.outputs);
    out.failures = std::move(before.failures);
    out.failures.push_back(item_error{*k, std::move(what)});
    out.failures.insert(out.failures.end(), after.failures.begin(), after.failures.end());
  }
  void end() override { inner_->end(); }
  void destroy() override { inner_->destroy(); }

 private:
  /// The first scripted throw among items [first, first + n), if any.
  std::optional<std::uint64_t> scripted_throw(std::uint64_t first, std::size_t n) const {
    auto t = sim_.throws_.find(index_);
    if (t == sim_.throws_.end()) return std::nullopt;
    std::optional<std::uint64_t> k;
    for (auto item : t->second)
      if (item >= first && item < first + n && (!k || item < *k)) k = item;
    return k;
  }

  std::unique_ptr<producer_ops> inner_;
  const sim_state& sim_;
  std::size_t index_;
};

}  // namespace

caf::behavior sim_producer(caf::event_based_actor* self, std::shared_ptr<sim_producer_state> st) {
  self->attach_functor([st] { st->real.destroy(); });
  return {
      [st](init_atom) -> caf::result<init_done> {
        if (st->sim->node_of(*st).dead)  // a runner made after its node was lost
          return make_error(errc::node_error, "node " + st->node +
                                                  " is down (killed or lost earlier in this "
                                                  "simulation)");
        auto r = st->real.init();
        if (st->real.producer)
          st->real.producer = std::make_unique<scripted_ops>(std::move(st->real.producer), *st->sim,
                                                             st->real.index);
        return r;
      },
      [self, st](const work_chunk& w) -> caf::result<chunk_result> {
        auto& sim = *st->sim;
        auto range = "job " + std::to_string(w.run) + " items " + std::to_string(w.first) + ".." +
                     std::to_string(w.first + w.items.size());
        if (!sim.chunk_arrived(st->node)) return caf::delegated<chunk_result>{};  // died with it
        sim.record(slot_name(*st) + " got " + range);
        // A node's producer gets its chunks over the network: it never folds (work_chunk::fold
        // does not travel), so a simulated one does not either.
        auto r = st->real.work(work_chunk{w.run, w.first, w.items, w.keep_going, nullptr});
        r.tag = w.tag;
        // Its time is virtual: the chunk's cost, from when the producer could start it.
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
      [st](end_atom) { return st->real.end(); },
  };
}

}  // namespace troupe::detail
