// The training coordinator's step as a pure state machine: events in (answers, losses, the
// clock passing a deadline), commands out through train_io (send shards, start a ring, reduce,
// apply, drop a replica). No CAF, no LibTorch, no clock: times come in as arguments. The real
// coordinator (trainer::impl, train_step.cpp) carries its commands to the replicas' actors and
// their answers back; the simulation (train_sim.cpp) carries them to simulated replicas in
// virtual time; the property tests (tests/train_core_properties_test.cpp) drive it with random
// schedules. What it decides: who computes which shards (by measured speed), what a lost replica's
// loss means (its shards computed again by the survivors, or in a local step its samples left out),
// which answers are late (given up on: never counted), when a step reduces in a ring and what a
// broken ring means (the whole step again, through the coordinator), a replica whose update
// failed (dropped), and how the step ends.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "train_core.hpp"

namespace troupe::detail::train_core {

/// How a step's gradients are summed; the same values as troupe::detail::reduction.
enum class reduce_mode : std::uint8_t { fast, deterministic, local, ring };

/// What the coordinator knows of a replica at a step's start.
struct replica_info {
  bool alive = true;
  bool local = true;      ///< in the coordinator's process
  bool has_port = false;  ///< on a node, with a data port for rings over the data plane
  double rate = 0;        ///< shards per second as measured; 0: not yet
};

/// The commands of the coordinator's step, carried out by its shell.
class train_io {
 public:
  virtual ~train_io() = default;
  /// A new attempt at the step, summed by `m`: what an earlier attempt summed is void. Returns
  /// the attempt's id (sent with its requests).
  virtual std::uint64_t begin_attempt(reduce_mode m) = 0;
  /// Sends shards [a, b) of the current attempt to `who`; returns the request's id.
  virtual std::uint64_t backward(std::size_t who, std::uint64_t a, std::uint64_t b) = 0;
  /// The answer to request `id` (the one being handed to answered()) counts: its sums and
  /// losses, for shards x.a .. x.b of replica x.who, are the step's.
  virtual void take(std::uint64_t id, const share& x) = 0;
  /// Starts an all-reduce of the attempt's sums among `ring` (in ring order), over the replicas'
  /// data ports or through CAF; returns one reply id per member, in ring order.
  virtual std::vector<std::uint64_t> ring(const std::vector<std::size_t>& ring, bool plane) = 0;
  /// Sums what the answers used so far hold (fast, deterministic) into the update.
  virtual void reduce() = 0;
  /// Sends the update (or in a local or ring step, the order to step) to `who`; returns the id.
  virtual std::uint64_t apply(std::size_t who) = 0;
  /// Takes `who` out of the run: `abandon` when it may be stuck (told to exit), else idle.
  virtual void drop(std::size_t who, bool abandon) = 0;
  /// `warn`: else informational.
  virtual void log(bool warn, const std::string& line) = 0;
};

/// Mistakes the property tests must catch (tests/train_core_properties_test.cpp), planted in the
/// coordinator itself on a cold path. Null in production.
enum class planted_mistake : int {
  none = 0,
  late_answer_used,    ///< a lost replica's answer that arrives late is used
  no_recompute,        ///< a lost replica's shards are not computed again
  recompute_answered,  ///< shards a lost replica answered (and the coordinator has) are redone
  duplicate_used,      ///< an answer that arrives twice is used twice
  ring_after_failure,  ///< a ring that failed with no replica lost leaves rings on
  broken_ring_used,    ///< a ring that broke is applied as if it completed
};
planted_mistake& planted();

class train_coordinator {
 public:
  using ns = std::chrono::nanoseconds;

  struct options {
    ns replica_timeout{0};    ///< 0: none
    bool direct_ring = true;  ///< rings may go over the replicas' data ports
  };
  struct step_input {
    std::uint64_t samples = 0, shard_size = 1;
    bool local = false;          ///< local_step(): each replica steps on its own shards
    bool deterministic = false;  ///< a fixed summation tree
    std::uint64_t steps_done = 0;
    std::uint64_t grad_bytes = 0;
  };
  enum class end {
    running,
    done,
    backward_failed,     ///< a replica's backward failed: `who`, `id` (nothing applied)
    apply_failed,        ///< a replica's step() threw: `who`, `id` (dropped; others stepped)
    no_replica,          ///< none alive at the start
    every_replica_lost,  ///< during the step
    internal,            ///< a shard not counted exactly once: `what`
  };
  struct outcome {
    end e = end::running;
    std::size_t who = 0;
    std::uint64_t id = 0;
    std::string what;
  };
  /// What one step did (added to the trainer's stats by the shell).
  struct counts {
    std::uint64_t recomputed_shards = 0, ring_reductions = 0, direct_ring_reductions = 0;
    std::uint64_t lost = 0;          ///< replicas lost or dropped during the step
    std::uint64_t lost_samples = 0;  ///< local: samples of replicas lost with their update
    ns reduce{0};                    ///< in the ring and the update
  };

  train_coordinator() = default;
  explicit train_coordinator(options o) : o_(o) {}

  /// Before a step (`local`: a local_step): whether every live replica must first take the
  /// first live one's state. Local steps leave the replicas' states apart; the first step that
  /// reduces after them starts every replica from the first one's. The shell copies, then
  /// begins the step.
  [[nodiscard]] bool sync_before(bool local) {
    if (local) {
      states_differ_ = true;
      return false;
    }
    bool sync = states_differ_;
    states_differ_ = false;
    return sync;
  }
  /// The replicas' states were made equal by other means (data_parallel::load).
  void states_equal() { states_differ_ = false; }

  /// Starts a step of `in.samples` samples on `replicas` (indexed as the shell's members).
  void begin(const step_input& in, std::vector<replica_info> replicas, ns now, train_io& io);
  /// An answer to request `id` (`ok`: not an error; `busy`: the replica's time on it). An
  /// answer to use is taken (train_io::take) before anything else; one given up on is ignored.
  void answered(std::uint64_t id, bool ok, double busy_seconds, ns now);
  /// `who` was lost (its actor ended, its node silent): the shell dropped it already.
  void lost(std::size_t who, ns now);
  /// The clock reached deadline().
  void tick(ns now);
  /// When tick() is due next; nullopt: wait for answers and losses only.
  [[nodiscard]] std::optional<ns> deadline() const;

  [[nodiscard]] bool finished() const { return result_.e != end::running; }
  [[nodiscard]] const outcome& result() const { return result_; }
  [[nodiscard]] const counts& step_counts() const { return counts_; }
  /// The replicas as the step left them (alive, measured rates).
  [[nodiscard]] const std::vector<replica_info>& replicas() const { return replicas_; }
  [[nodiscard]] reduce_mode mode() const { return mode_; }
  [[nodiscard]] const transport_policy& transport() const { return transport_; }
  [[nodiscard]] std::uint64_t shards() const { return shards_; }

 private:
  enum class phase { idle, backward, ring, apply, done };
  enum class kind { backward, ring, apply };
  struct request {
    kind k = kind::backward;
    std::size_t who = 0;
    ns sent{0};
    std::uint64_t a = 0, b = 0;  ///< backward: its shards
  };

  std::vector<std::size_t> alive() const;
  /// The measured rates of `who`, in that order (for split()).
  std::vector<double> rates_of(const std::vector<std::size_t>& who) const;
  void start_compute();
  void dispatch(std::size_t who, std::uint64_t a, std::uint64_t b);
  void recompute(const std::vector<range>& ranges);
  void backward_maybe_done();
  void start_ring();
  void ring_broken(transport_policy::ring_end why);
  void start_apply();
  void apply_maybe_done();
  void finish(end e, std::size_t who = 0, std::uint64_t id = 0, std::string what = {});

  options o_;
  transport_policy transport_;
  train_io* io_ = nullptr;
  step_input in_;
  std::uint64_t shards_ = 0;
  std::vector<replica_info> replicas_;
  phase phase_ = phase::idle;
  reduce_mode mode_ = reduce_mode::fast;
  ledger book_;
  std::map<std::uint64_t, request> pending_;
  std::vector<std::size_t> stepped_;  ///< local: who holds its own update
  /// This attempt's answers used, and requests given up on: kept only while a mistake is
  /// planted (the only reader).
  std::map<std::uint64_t, share> used_, given_up_;
  std::optional<std::pair<std::size_t, std::uint64_t>> failure_;        ///< backward
  std::optional<std::pair<std::size_t, std::uint64_t>> apply_failure_;  ///< apply
  /// After a ring that broke: why, and the losses before the step was computed again.
  std::optional<transport_policy::ring_end> broken_;
  std::uint64_t lost_before_ = 0;
  ns now_{0}, ring_started_{0}, reduce_started_{0};
  bool plane_ = false;
  bool states_differ_ = false;  ///< local steps since the replicas' states were last equal
  counts counts_;
  outcome result_;
};

}  // namespace troupe::detail::train_core
