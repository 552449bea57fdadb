// Data-parallel training: the coordinator (trainer::impl). Its requests to the replicas:
// train_requests.cpp; a step: train_step.cpp; starting, adding and removing replicas, following
// a cluster: train_members.cpp; trainer's public functions: train.cpp.
#pragma once

#include <caf/scoped_actor.hpp>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>

#include "train_coordinator.hpp"
#include "train_msg.hpp"
#include "troupe/detail/cluster_state.hpp"
#include "troupe/detail/introspect.hpp"
#include "troupe/detail/network.hpp"
#include "troupe/internal/bulk.hpp"
#include "troupe/log.hpp"

namespace troupe::detail {

/// The answer (a train_msg, or init's init_reply) a replica's chunk_result holds; an answer
/// that holds none becomes a protocol_error (in `r`).
template <class Answer = train_msg>
Answer answer_of(chunk_result& r) {
  Answer msg;
  if (!r.ok()) return msg;
  try {
    auto joined = bulk::resolve(r.outputs);
    auto* b = joined.as<Answer>();
    if (b == nullptr || b->items.size() != 1) throw protocol_error("not a training answer");
    msg = std::move(b->items[0]);
  } catch (const std::exception& e) {
    r.code = errc::protocol_error;
    r.what = e.what();
  }
  return msg;
}

struct trainer::impl {
  /// data_parallel built from a live cluster: the cluster's changes, applied between steps (a
  /// change waits for the step under way: `calls`). Registered before the trainer exists
  /// (attached_follower).
  struct follower final : attached_follower<impl> {
   protected:
    void apply(impl& p, const membership_event& e) const override { p.follow_change(e); }
    bool only_on(impl& p, const std::string& node) const override { return p.only_on(node); }
    [[nodiscard]] std::string name() const override { return "data_parallel"; }
  };
  /// One call at a time (the caller's, or a cluster's change between steps).
  std::recursive_mutex calls;
  std::shared_ptr<cluster_state> cluster;  ///< the cluster it follows, if any
  std::shared_ptr<follower> follows;
  /// Replicas on `devices` (constructed in order), given the others' state.
  void add(const std::vector<device>& devices);
  /// The replicas on `devices` leave (between steps).
  void remove(const std::vector<device>& devices);
  /// A cluster's change: joined / rejoined nodes get replicas, draining ones leave.
  void follow_change(const membership_event& e);
  /// Whether every live replica is on `node`.
  bool only_on(const std::string& node);

  struct member {
    device d;
    caf::actor a;
    double rate = 0;  ///< shards per second, 0 before the first measurement
    bool alive = true;
    /// The port where it takes its left ring neighbour's data (ring_plane.hpp), 0: none.
    std::uint16_t data_port = 0;
    /// Its replica type carries its optimizer's state (optimizer() or save/load).
    bool carries_state = true;
    /// Its actor is gone or given up on (lost, stuck, retired): never waited for again.
    bool gone = false;
    replica_stats st;
  };
  /// A request on its way: to whom, and (backward) which shards.
  struct pending {
    std::size_t member = 0;
    clock::time_point sent;
    std::uint64_t a = 0, b = 0;
  };
  /// The first failed answer among a batch of requests (thrown once all answers are in).
  struct first_failure {
    std::optional<chunk_result> result;
    std::size_t member = 0;
    /// Keeps `r` when it failed and is the first to; true when it failed.
    bool failed(const pending& p, const chunk_result& r) {
      if (r.ok()) return false;
      if (!result) {
        result = r;
        member = p.member;
      }
      return true;
    }
  };

  config cfg;
  train_options o;
  std::string job;
  replica_maker make = nullptr;
  std::string signature;
  bool networked = false;  ///< on the process's network system (else on the local one)
  caf::actor_system* sys = nullptr;
  std::unique_ptr<caf::scoped_actor> self;
  caf::actor owner;  ///< nodes end our replicas when this actor ends
  std::map<std::string, caf::actor> nodes;
  /// Connecting to a node and its answer to a spawn (the cluster's connect_timeout for both,
  /// once following one).
  node_deadlines deadlines;
  std::vector<member> members;
  std::uint64_t next_id = 1;
  train_stats stats;
  /// What metrics read (trainers()): published after each step and membership change.
  std::shared_ptr<published<trainer_view>> numbers;
  /// Never throws (called from destructors of scope guards); a failure leaves the old view.
  void publish() noexcept;
  std::uint64_t grad_bytes = 0;  ///< of one replica's flat gradient
  /// The step's decisions (train_coordinator.hpp), and its transport policy across steps: ring
  /// or coordinator, plane or CAF, the pause after late rings. Made at the first step.
  std::optional<train_core::train_coordinator> coordinator;
  /// One step's commands carried to the replicas (train_step.cpp).
  struct step_shell;
  /// The training's state (parameters, optimizer: a get_state's bytes) while no replica holds
  /// it: taken from the last replica removed, or given to load() with none; the next replicas
  /// added start from it.
  at::Tensor held_state;
  bool loaded = false;  ///< load() was called: the state is no longer the constructors'
  /// Whether the training's state left with its last replica (lost, not removed): adding
  /// replicas would silently start over from the constructors' model.
  [[nodiscard]] bool state_gone() {
    return alive().empty() && !held_state.defined() && (stats.steps > 0 || loaded);
  }
  /// A replica type without optimizer() or save/load joined a run: warned about (once).
  bool warned_fresh_state = false;
  /// Counts (and warns about, once) the replicas among `fresh` whose optimizer started fresh.
  void note_fresh_state(const std::vector<std::size_t>& fresh);

  ~impl();
  /// How long the destructor waits for local replicas to free what they hold.
  static constexpr std::chrono::seconds release_wait{5};

  std::vector<std::size_t> alive() const;
  std::uint64_t send(std::size_t who, train_msg msg);
  /// Takes `who` out of the step. Its actor is told to exit (`abandon`: it may be stuck, or is
  /// gone already), or, a local one that is idle, left to `retire` (which waits for it to free
  /// its tensors and device).
  void drop(std::size_t who, bool abandon = true);
  /// Drops `who`, replicas that are idle (they answered), and retires them.
  void drop_idle(const std::vector<std::size_t>& who);
  /// Local replicas among `who` free everything they hold (waited for, at most release_wait
  /// for one still busy in user code, which is then left behind); the others are told to exit.
  void retire(const std::vector<std::size_t>& who);

  /// Waits for every request in `waiting`: `on_reply(id, pending, result, msg)` for answers,
  /// `on_lost(pending)` for requests whose replica was lost (dropped first).
  /// With `replica_timeout`, requests older than it are lost (their replicas dropped), unless
  /// `on_late` is given: then it is called instead, and decides.
  template <class Answer = train_msg, class OnReply, class OnLost, class OnLate = std::nullptr_t>
  void wait(std::map<std::uint64_t, pending>& waiting, OnReply on_reply, OnLost on_lost,
            OnLate on_late = nullptr) {
    auto lose = [&](std::size_t who) {
      drop(who);
      std::vector<pending> gone;
      for (auto it = waiting.begin(); it != waiting.end();) {
        if (it->second.member == who) {
          gone.push_back(it->second);
          it = waiting.erase(it);
        } else {
          ++it;
        }
      }
      for (auto& p : gone) on_lost(p);
    };
    while (!waiting.empty()) {
      auto on_result = [&](chunk_result& r) {
        auto it = waiting.find(r.run);
        if (it == waiting.end()) return;  // a request given up on
        auto p = it->second;
        waiting.erase(it);
        auto msg = answer_of<Answer>(r);
        on_reply(p, r, msg);
      };
      auto on_down = [&](caf::down_msg& dm) {
        for (std::size_t i = 0; i < members.size(); ++i)
          if (members[i].alive && members[i].a.address() == dm.source) lose(i);
      };
      if (o.replica_timeout.count() > 0) {
        auto first = clock::time_point::max();
        for (auto& [id, p] : waiting) first = std::min(first, p.sent);
        // Rounded up: a wait rounded down to 0 ms would poll until the deadline.
        auto left =
            std::chrono::ceil<std::chrono::milliseconds>(first + o.replica_timeout - clock::now());
        bool late = false;
        (*self)->receive(
            on_result, on_down, [](const bulk::fragment&) {},
            caf::after(std::max(left, std::chrono::milliseconds{0})) >> [&] { late = true; });
        if constexpr (!std::is_same_v<OnLate, std::nullptr_t>) {
          if (late) on_late();
        } else if (late) {
          auto now = clock::now();
          std::vector<std::size_t> slow;
          for (auto& [id, p] : waiting)
            if (now - p.sent >= o.replica_timeout) slow.push_back(p.member);
          for (auto who : slow) lose(who);
        }
      } else {
        (*self)->receive(on_result, on_down, [](const bulk::fragment&) {});
      }
    }
  }

  /// Sends `msg` to each of `who` and waits for all; returns the answers (Answer: train_msg,
  /// or init_reply for op::init) by member. Throws the
  /// first error (after every answer is in); lost members are dropped.
  /// `drop_failed`: when some (not all) of `who` fail, those are dropped (and retired) before
  /// the error is thrown, so that the others stay identical (a command that changes state).
  template <class Answer = train_msg>
  std::map<std::size_t, Answer> everyone(const std::vector<std::size_t>& who, const train_msg& msg,
                                         bool drop_failed = false);
  [[noreturn]] void raise(const chunk_result& r, std::size_t who);
  /// `fresh` in rounds that hold at most one replica per process (the caller's, or a node's):
  /// the k-th round holds the k-th replica of each process, in member order.
  std::vector<std::vector<std::size_t>> construction_rounds(const std::vector<std::size_t>& fresh);
  /// Spawns and starts replicas on `devices`; returns their member indexes.
  std::vector<std::size_t> start(const std::vector<device>& devices);
  /// Copies the state (parameters, optimizer) of the first live replica not in `to` into `to`,
  /// or, with none, the state held (held_state); throws node_error when the state is gone.
  void copy_state(const std::vector<std::size_t>& to);
  /// held_state = `from`'s state (a warning when it cannot be read).
  void keep_state(std::size_t from);
  /// node_error when state_gone(): replicas added now would start over, silently.
  void refuse_if_state_gone();
  double step(const batch& samples, mode m);
  std::map<std::size_t, train_msg> get_params(const std::vector<std::size_t>& who);
};

}  // namespace troupe::detail
