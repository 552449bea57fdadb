// The scheduler actor: a thin shell around the scheduler's core (scheduler.hpp). It turns CAF's
// messages, answers, errors and monitors into the core's events, and runs the core's commands
// with CAF: requests to producers and consumers, exits, replacements, timers. Bulk payloads are
// split and joined here, at the edge: the core sees whole batches.
#include <algorithm>
#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <unordered_map>

#include "runtime_impl.hpp"
#include "scheduler.hpp"
#include "troupe/internal/bulk.hpp"

namespace troupe::detail {

std::atomic<void (*)()> fault_points::before_wake{nullptr};
std::atomic<bool> fault_points::check_indexes{false};

namespace {

class scheduler_shell final : public scheduler_io {
 public:
  scheduler_shell(caf::event_based_actor* self, std::vector<caf::actor> producers,
                  std::vector<device> devices, options opts, std::shared_ptr<stats_box> stats,
                  producer_spawner spawn, config cfg, std::shared_ptr<std::atomic<bool>> halted,
                  std::vector<caf::actor> nodes, planted_bug planted)
      : self_(self),
        halted_(std::move(halted)),
        planted_(planted),
        handles_(std::move(producers)),
        nodes_(std::move(nodes)),
        devices_(devices),
        spawn_(std::move(spawn)),
        cfg_(std::move(cfg)),
        core_(*this, std::move(devices), std::move(opts), std::move(stats)) {
    // CAF 0.17 never fails a request to a dead node: monitors (and heartbeats) tell us.
    for (std::size_t p = 0; p < handles_.size(); ++p) watch(p);
    // An error as a message (not a response) is CAF's answer to a chunk whose producer failed
    // it (send_chunk): by default CAF would end this actor.
    self_->set_error_handler([this](caf::error& err) { answered(err); });
    self_->set_down_handler([this](caf::down_msg& dm) {
      // By address, not by a scan of every slot: a node lost with its producers at 8,000
      // producers was a scan per producer (BENCHMARKS, "the scheduler's cost as the pool grows").
      auto it = slot_of_.find(dm.source);
      if (it == slot_of_.end()) return;  // a replaced producer's old actor
      auto p = it->second;
      slot_of_.erase(it);
      if (auto* c = core())
        c->producer_down(p, error_text(dm.reason), dm.reason == caf::exit_reason::unreachable);
    });
  }

  /// The core, for an event; nullptr once halted (the event is dropped).
  scheduler* core() { return halted_ && halted_->load() ? nullptr : &core_; }

  /// A draining node's producers: drained like remove_devices (nobody waits for it here). One
  /// this actor does not know yet (add_devices still waits for its init: the node drained
  /// meanwhile) is remembered and drained as soon as add() brings it.
  void leaving(const std::vector<caf::actor>& producers) {
    std::vector<std::size_t> slots;
    for (auto& a : producers) {
      if (auto it = slot_of_.find(a.address()); it != slot_of_.end()) {
        slots.push_back(it->second);
      } else if (a) {
        if (leaving_soon_.size() >= max_leaving_soon) leaving_soon_.erase(leaving_soon_.begin());
        leaving_soon_.push_back(a.address());
      }
    }
    drain(slots);
  }

  void drain(const std::vector<std::size_t>& slots) {
    if (slots.empty()) return;
    if (auto* c = core()) c->drain(slots, std::make_shared<std::promise<void>>());
  }

  /// The cluster gave up on `node` (silent, or restarted): its producers are lost now, and
  /// whatever they answer later is dropped (their generation moved on).
  void fence(const std::string& node) {
    for (std::size_t p = 0; p < handles_.size(); ++p) {
      if (!handles_[p] || devices_[p].is_local() || devices_[p].node() != node) continue;
      if (auto* c = core())
        c->producer_down(p, "its node " + node + " was given up on by its cluster", false);
      self_->send_exit(handles_[p], caf::exit_reason::user_shutdown);
    }
  }

  void add(producers_added& a) {
    auto* c = core();
    if (!c || a.first != handles_.size()) {  // halted (or a slot mix-up, which cannot happen)
      for (auto& h : a.actors) self_->send_exit(h, caf::exit_reason::user_shutdown);
      a.done->set_value();
      return;
    }
    nodes_.resize(handles_.size());
    for (std::size_t i = 0; i < a.actors.size(); ++i) {
      nodes_.push_back(i < a.nodes.size() ? a.nodes[i] : caf::actor{});
      handles_.push_back(a.actors[i]);
      devices_.push_back(a.where[i]);
      watch(handles_.size() - 1);
    }
    c->add_producers(a.where);
    std::vector<std::size_t> left;  // their node drained while they started
    for (std::size_t p = a.first; p < handles_.size(); ++p) {
      auto i = std::find(leaving_soon_.begin(), leaving_soon_.end(), handles_[p].address());
      if (i == leaving_soon_.end()) continue;
      leaving_soon_.erase(i);
      left.push_back(p);
    }
    drain(left);
    a.done->set_value();
  }

  void start(std::shared_ptr<job_spec>& spec) {
    consumers_[spec->core->id()] = std::move(spec->consumer);
    if (auto* c = core())
      c->start(std::move(spec->core), std::move(spec->source), spec->ordered, std::move(spec->opts),
               spec->fold);
  }

  // -- the core's commands ----------------------------------------------------------------

  clock_type::time_point now() override { return self_->home_system().clock().now(); }

  void send_chunk(std::size_t p, std::uint64_t gen, std::uint64_t id, work_chunk msg) override {
    msg.tag = chunk_tag{p, gen, id};
    // A large chunk for a remote producer travels as fragments, then a small reference.
    msg.items = bulk::split_for(self_, handles_[p], msg.items);
    if (handles_[p]) {
      // A plain message (chunk_tag): the producer's answer comes back as one, to answered().
      self_->send(handles_[p], std::move(msg));
      return;
    }
    // A slot let go of (forget_producer): a request to an empty handle fails at once.
    self_->request(handles_[p], caf::infinite, std::move(msg))
        .then([](chunk_result&) {},
              [this, p, gen](caf::error& err) {
                if (auto* c = core()) c->producer_failed(p, gen, error_text(err), false);
              });
  }

  /// A producer's answer to send_chunk. From an actor other than the one its slot holds now (a
  /// producer replaced or let go of, or a tag that is not its own) it goes to the core as an
  /// answer of no generation: dropped there as a late one.
  void answered(chunk_result& r) {
    // Joined first, even for an answer the core drops, so that its fragments are released.
    try {
      r.outputs = bulk::resolve(r.outputs);
    } catch (const std::exception& e) {
      r.outputs = {};
      if (r.ok()) {
        r.code = errc::protocol_error;
        r.what = e.what();
      }
    }
    auto p = r.tag.slot;
    if (p >= handles_.size()) return;
    auto gen = r.tag.gen;
    if (!handles_[p] || handles_[p].address() != self_->current_sender()) gen = ~gen;
    if (auto* c = core()) c->on_result(static_cast<std::size_t>(p), gen, r.run, r.tag.id, r);
  }

  /// An error in answer to a chunk (a producer that has no handler for it, or one that quit on
  /// it): that producer, the actor its slot holds now, is given up on, as a request's error
  /// was. Errors from anyone else are dropped.
  void answered(caf::error& err) {
    auto from = caf::actor_cast<caf::actor_addr>(self_->current_sender());
    auto it = slot_of_.find(from);
    if (it == slot_of_.end()) {
      // A consumer that failed a chunk (consume): its job fails.
      for (auto& [job, a] : consumers_) {
        if (a.address() != from) continue;
        if (auto* c = core()) c->consumer_failed(job, error_text(err));
        return;
      }
      return;
    }
    auto p = it->second;
    if (auto* c = core())
      c->producer_failed(p, c->generation(p), error_text(err),
                         err == caf::exit_reason::unreachable);
  }

  void end_producer(std::size_t p) override {
    self_->request(handles_[p], caf::infinite, end_atom::value)
        .then(
            [this, p](const consume_ack&) {
              if (auto* c = core()) c->producer_ended(p, {});
            },
            [this, p](const caf::error& err) {
              if (auto* c = core()) c->producer_ended(p, error_text(err));
            });
  }

  void stop_producer(std::size_t p) override {
    if (!handles_[p]) return;
    self_->send_exit(handles_[p], caf::exit_reason::user_shutdown);
    forget_producer(p);
  }

  void forget_producer(std::size_t p) override {
    if (!handles_[p]) return;
    // Let it go: a detached actor's thread lives until its actor is destroyed, so a removed
    // local producer whose handle stayed here kept its thread (and ~1 kB) for the runner's
    // life: 2,000 add_devices/remove_devices left 2,000 threads; a lost node producer kept its
    // proxy. Its down is not needed (the core stopped it or gave up on it); a request to an
    // empty handle fails at once (sec::invalid_argument). A node ends the producers it still
    // runs for this runner when the runner's anchor actor ends.
    slot_of_.erase(handles_[p].address());
    handles_[p] = caf::actor{};
    if (p < nodes_.size()) nodes_[p] = caf::actor{};
  }

  void replace_producer(std::size_t p, std::uint64_t gen) override {
    auto fresh = spawn_(self_->system(), devices_[p], cfg_, p);  // may throw: the core logs it
    if (handles_[p])
      slot_of_.erase(handles_[p].address());  // its down, if still to come, is dropped
    handles_[p] = fresh;
    watch(p);
    self_->request(fresh, caf::infinite, init_atom::value)
        .then(
            [this, p, gen](const init_done&) {
              if (auto* c = core()) c->replaced(p, gen);
            },
            [this, p, gen](const caf::error& err) {
              if (auto* c = core()) c->replace_failed(p, gen, error_text(err));
            });
  }

  void consume(consume_chunk msg, std::size_t) override {
    auto job = msg.run;
    if (auto& to = consumers_[job]) {
      // A plain message: the consumer counts it in the job's gate and acknowledges it only
      // when the core waits for it (consumer_acked); its error comes back as a message too.
      self_->send(to, std::move(msg));
      return;
    }
    // No consumer (the job's is gone): a request to an empty handle fails at once.
    self_->request(consumers_[job], caf::infinite, std::move(msg))
        .then(
            [this, job](const consume_ack&) {
              if (auto* c = core()) c->consumer_acked(job);
            },
            [this, job](caf::error& err) {
              if (auto* c = core()) c->consumer_failed(job, error_text(err));
            });
  }

  void end_input(std::uint64_t job) override {
    self_->request(consumers_[job], caf::infinite, end_of_input{job})
        .then(
            [this, job](const consume_ack&) {
              if (auto* c = core()) c->input_ended(job);
            },
            [this, job](caf::error& err) {
              if (auto* c = core()) c->consumer_failed(job, error_text(err));
            });
  }

  void set_timer(std::chrono::nanoseconds after, timer t, std::uint64_t id) override {
    auto d = std::chrono::duration_cast<std::chrono::microseconds>(after);
    if (d.count() <= 0) {
      self_->send(self_, timer_atom::value, static_cast<int>(t), id);
      return;
    }
    self_->delayed_send(self_, d, timer_atom::value, static_cast<int>(t), id);
  }

  void forget_job(std::uint64_t job) override { consumers_.erase(job); }

  [[nodiscard]] bool cuts_reach(std::size_t p, const device& d) const override {
    return d.is_local() || (p < nodes_.size() && nodes_[p]);
  }

  void trim_remote(std::size_t p, std::uint64_t gen, std::uint64_t job, std::uint64_t id,
                   std::uint64_t cut_id, std::uint64_t items, bool all, bool ask) override {
    // To the node's actor: the producer's own mailbox is busy while it works. A node that does
    // not answer (dead: its loss comes as a down) leaves the chunk as it is after 10 s.
    auto back = [this, p, gen, job, id](std::int64_t kept) {
      if (auto* c = core()) c->trimmed(p, gen, job, id, kept);
    };
    self_
        ->request(nodes_[p], std::chrono::seconds{10}, trim_atom::value,
                  handles_[p] ? handles_[p].id() : caf::actor_id{0}, cut_id, items, all, ask)
        .then([back](std::int64_t kept) { back(kept); }, [back](caf::error&) { back(-1); });
  }

  void quit() override { self_->quit(); }

  [[nodiscard]] planted_bug planted() const override { return planted_; }

 private:
  /// Monitors slot p's actor and indexes it by address (its down finds the slot).
  void watch(std::size_t p) {
    if (!handles_[p]) return;
    slot_of_[handles_[p].address()] = p;
    self_->monitor(handles_[p]);
  }

  caf::event_based_actor* self_;
  std::shared_ptr<std::atomic<bool>> halted_;
  planted_bug planted_;              ///< none but in a simulation that tests plant a mistake in
  std::vector<caf::actor> handles_;  ///< the producers' actors, by slot
  std::vector<caf::actor> nodes_;    ///< a node producer's node actor (trims), by slot
  std::unordered_map<caf::actor_addr, std::size_t> slot_of_;  ///< live handles_, by address
  /// Producers whose node drained before add() brought them (leaving): the newest few.
  static constexpr std::size_t max_leaving_soon = 1024;
  std::vector<caf::actor_addr> leaving_soon_;
  std::vector<device> devices_;
  producer_spawner spawn_;
  config cfg_;
  std::unordered_map<std::uint64_t, caf::actor> consumers_;  ///< by job
  scheduler core_;                                           ///< last: it calls the above
};

}  // namespace

caf::actor spawn_scheduler(caf::actor_system& sys, std::vector<caf::actor> producers,
                           std::vector<device> devices, options opts,
                           std::shared_ptr<stats_box> stats, producer_spawner spawn, config cfg,
                           bool detached, std::shared_ptr<std::atomic<bool>> halted,
                           std::vector<caf::actor> nodes, planted_bug planted) {
  // The state travels as a spawn argument: a spawn without arguments makes CAF 0.17.6
  // dereference a null std::shared_ptr<std::tuple<>> (UBSan reports it).
  auto init = [producers = std::move(producers), devices = std::move(devices),
               opts = std::move(opts), spawn = std::move(spawn), cfg = std::move(cfg),
               halted = std::move(halted), nodes = std::move(nodes),
               planted](caf::event_based_actor* self,
                        std::shared_ptr<stats_box> box) mutable -> caf::behavior {
    auto st = std::make_shared<scheduler_shell>(self, std::move(producers), std::move(devices),
                                                std::move(opts), std::move(box), std::move(spawn),
                                                std::move(cfg), halted, std::move(nodes), planted);
    return {
        [st](std::shared_ptr<job_spec>& spec) {
          mark_internal_thread();
          st->start(spec);
        },
        [st](std::shared_ptr<producers_added>& a) {
          mark_internal_thread();
          st->add(*a);
        },
        [st](std::shared_ptr<drain_spec>& d) {
          mark_internal_thread();
          if (auto* c = st->core())
            c->drain(d->slots, d->done);
          else
            d->done->set_value();
        },
        [st](leaving_atom, std::vector<caf::actor>& producers) {
          mark_internal_thread();
          st->leaving(producers);
        },
        [st](fence_atom, const std::string& node) {
          mark_internal_thread();
          st->fence(node);
        },
        [st](cancel_atom, std::uint64_t id) {
          mark_internal_thread();
          if (auto* c = st->core()) c->cancel(id);
          return consume_ack{id};
        },
        [st](timer_atom, int t, std::uint64_t id) {
          mark_internal_thread();
          if (auto* c = st->core()) c->timer_fired(static_cast<scheduler_io::timer>(t), id);
        },
        [st](close_atom, std::shared_ptr<std::promise<void>>& done, bool timed) {
          mark_internal_thread();
          if (auto* c = st->core())
            c->close(std::move(done), timed);
          else
            done->set_value();
        },
        // The runner's close() gave up waiting: the producers still busy are left behind.
        [st](close_timeout_atom) {
          if (auto* c = st->core()) c->timer_fired(scheduler_io::timer::close_timeout, 0);
        },
        [st](chunk_result& r) { st->answered(r); },
        // A consumer's acknowledgement of the scheduler's plain consume_chunk messages.
        [st](const consume_ack& a) {
          if (auto* c = st->core()) c->consumer_acked(a.run);
        },
        [](const bulk::fragment&) {},  // joined while it was deserialized
    };
  };
  if (!detached) return sys.spawn(std::move(init), std::move(stats));
  return sys.spawn<caf::detached>(std::move(init), std::move(stats));
}

}  // namespace troupe::detail
