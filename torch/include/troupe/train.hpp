// Data-parallel training (docs/api.md, "Training"): one replica of a model per device, local or
// on nodes; each step splits a batch into shards, reduces the shards' gradients once, and applies
// the same update on every replica. Link troupe::torch.
//
//   struct mlp_sgd {
//     struct replica {
//       replica(const troupe::device& d, const troupe::config& cfg);
//       std::vector<torch::Tensor> parameters();
//       double backward(const std::vector<sample>& shard);  // SUMMED loss, grads into .grad()
//       void step();                                        // optimizer step
//       torch::optim::Optimizer& optimizer();  // optional: its state follows the replicas
//       // optional: void save(torch::serialize::OutputArchive&); void load(...InputArchive&);
//     };
//   };
//   TROUPE_REGISTER_JOB(mlp_sgd);   // after including this header; nodes can then hold replicas
//   troupe::data_parallel<mlp_sgd> dp{devices, cfg, opts};
//   double loss = dp.step(batch);
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "troupe/batch.hpp"
#include "troupe/config.hpp"
#include "troupe/detail/runtime.hpp"
#include "troupe/device.hpp"
#include "troupe/error.hpp"
#include "troupe/node.hpp"
#include "troupe/register.hpp"
#include "troupe/tensor.hpp"

namespace troupe {

struct train_options {
  /// Samples per shard: the unit of work, of load balancing and of recomputation after a loss.
  std::size_t shard_size = 32;
  /// true: a step's result depends only on the batch and shard_size (shard gradients summed in a
  /// fixed binary tree over shard indices), never on the number, speed or failures of the
  /// replicas; bit for bit on one device type. false: each replica sums its own shards and the
  /// coordinator sums the replicas' partial sums (fewer, larger transfers).
  bool deterministic = false;
  /// Longest wait for one replica's answer (0: no limit of its own). Replicas on nodes are given
  /// up on anyway when their node goes silent (limits::idle_timeout, 1.5 s by default); this
  /// bounds a replica that is alive but stuck. A replica that passes it is dropped, and its
  /// shards are recomputed by the others.
  std::chrono::milliseconds replica_timeout{0};
  /// Rings among replicas on nodes move their data over direct TCP connections between the
  /// replicas (each listens on a port of its own, chosen by the system, on the host its node
  /// serves on; a connection must present the ring's random key first). Used when every
  /// replica of the ring is on a node served without TLS and holds its parameters on a CPU;
  /// otherwise, or with false here (a firewall that opens only the nodes' ports, say), the
  /// data goes through CAF's connections (TLS included), at about two thirds of the bandwidth.
  bool direct_ring = true;
};

/// One replica's share of the work so far.
struct replica_stats {
  std::string device;
  std::uint64_t shards = 0;  ///< shards whose backward it computed (recomputations included)
  double busy_seconds = 0;   ///< time inside backward() and its gradient copies
  bool lost = false;         ///< dropped (node lost, timeout, failed step())
};

struct train_stats {
  std::uint64_t steps = 0;              ///< step() and local_step() calls that completed
  std::uint64_t shards = 0;             ///< shards in those steps
  std::uint64_t recomputed_shards = 0;  ///< shards computed again after their replica was lost
  std::uint64_t lost_replicas = 0;
  /// Replicas that joined a run (cluster::add, a rejoin, add_devices) whose type has neither
  /// optimizer() nor save/load: their optimizer started fresh (momentum, Adam's moments and step
  /// counts empty), so they compute other updates than the others. Warned about once.
  std::uint64_t fresh_state_joins = 0;
  /// Steps whose gradients the replicas all-reduced among themselves in a ring (fast mode,
  /// replicas on nodes, gradients of at least 256 KiB); the others went through the
  /// coordinator.
  std::uint64_t ring_reductions = 0;
  /// Of those, the rings whose data went over direct connections between the replicas (every
  /// replica on a node served without TLS, on a CPU; docs/api.md, "The ring's data"); the others'
  /// went through CAF.
  std::uint64_t direct_ring_reductions = 0;
  /// Summing gradients (on the coordinator, or the ring among replicas) and applying the update;
  /// the partial sums' way to the coordinator counts in the step, not here.
  double reduce_seconds = 0;
  double step_seconds = 0;              ///< wall time of the completed steps
  std::vector<replica_stats> replicas;  ///< in device order (removed devices included)
};

namespace detail {

/// A job's replica object behind a small interface (the only part instantiated in the user's
/// translation unit; the actors, reduction and recovery are compiled once, in troupe::torch).
class replica_ops {
 public:
  virtual ~replica_ops() = default;
  virtual std::vector<at::Tensor> parameters() = 0;
  /// replica::backward on samples [begin, end) of `samples`; returns the summed loss. Throws
  /// protocol_error when the batch holds another type.
  virtual double backward(const batch& samples, std::size_t begin, std::size_t end) = 0;
  virtual void step() = 0;
  /// replica::optimizer() when the replica has one (troupe saves and loads its state), else null.
  virtual torch::optim::Optimizer* optimizer() = 0;
  /// replica::save/load when the replica has them (anything else to carry); false/no-op
  /// otherwise.
  virtual bool save(torch::serialize::OutputArchive& archive) = 0;
  virtual void load(torch::serialize::InputArchive& archive) = 0;
  /// Whether the replica's state beyond its parameters travels (optimizer() or save/load).
  [[nodiscard]] virtual bool carries_state() const = 0;
};

/// Constructs a job's replica on `d`, on the replica's own thread.
using replica_maker = std::unique_ptr<replica_ops> (*)(const device& d, const config& cfg);

template <class R, class = void>
struct replica_saves : std::false_type {};
template <class R>
struct replica_saves<R, std::void_t<decltype(std::declval<R&>().save(
                            std::declval<torch::serialize::OutputArchive&>()))>> : std::true_type {
};

template <class R, class = void>
struct replica_optimizes : std::false_type {};
template <class R>
struct replica_optimizes<R, std::void_t<decltype(std::declval<R&>().optimizer())>>
    : std::is_convertible<decltype(std::declval<R&>().optimizer()), torch::optim::Optimizer&> {};

template <class T>
struct vector_value;
template <class T, class A>
struct vector_value<std::vector<T, A>> {
  using type = T;
};

/// What a job's replica looks like to troupe: checked with static_asserts naming the member.
template <class Job>
struct replica_traits {
  static_assert(has_replica<Job>::value,
                "troupe: data_parallel needs a job with a nested `struct replica`");
  using replica_type = typename Job::replica;
  static_assert(std::is_constructible<replica_type, const device&, const config&>::value ||
                    std::is_constructible<replica_type, const device&>::value,
                "troupe: Job::replica needs a constructor (const troupe::device&, const "
                "troupe::config&) or (const troupe::device&)");
  using shard_arg = std::decay_t<typename member_fn<decltype(&replica_type::backward)>::arg>;
  using sample_type = typename vector_value<shard_arg>::type;
  static_assert(std::is_convertible<typename member_fn<decltype(&replica_type::backward)>::result,
                                    double>::value,
                "troupe: Job::replica::backward(const std::vector<Sample>&) must return the "
                "shard's summed loss");
};

template <class Job>
class replica_impl final : public replica_ops {
  using traits = replica_traits<Job>;
  using R = typename traits::replica_type;
  using S = typename traits::sample_type;

 public:
  replica_impl(const device& d, const config& cfg) : r_(make(d, cfg)) {}
  std::vector<at::Tensor> parameters() override { return r_.parameters(); }
  double backward(const batch& samples, std::size_t begin, std::size_t end) override {
    auto [data, n] = samples.span<S>();
    if (data == nullptr || end > n || begin > end)
      throw protocol_error("a shard holds samples of another type than the replica's");
    shard_.assign(data + begin, data + end);
    return static_cast<double>(r_.backward(shard_));
  }
  void step() override { r_.step(); }
  torch::optim::Optimizer* optimizer() override {
    if constexpr (replica_optimizes<R>::value) {
      torch::optim::Optimizer& o = r_.optimizer();
      return &o;
    } else {
      return nullptr;
    }
  }
  [[nodiscard]] bool carries_state() const override {
    return replica_optimizes<R>::value || replica_saves<R>::value;
  }
  bool save(torch::serialize::OutputArchive& archive) override {
    if constexpr (replica_saves<R>::value) {
      r_.save(archive);
      return true;
    } else {
      (void)archive;
      return false;
    }
  }
  void load(torch::serialize::InputArchive& archive) override {
    if constexpr (replica_saves<R>::value)
      r_.load(archive);
    else
      (void)archive;
  }

  static std::unique_ptr<replica_ops> create(const device& d, const config& cfg) {
    return std::make_unique<replica_impl>(d, cfg);
  }

 private:
  static R make(const device& d, const config& cfg) {
    if constexpr (std::is_constructible<R, const device&, const config&>::value)
      return R(d, cfg);
    else
      return R(d);
  }
  R r_;
  std::vector<S> shard_;
};

/// "replica of SAMPLE": what a coordinator and a node must agree on for a training job.
std::string replica_signature(const std::type_info& sample);

/// Registers `name` as a job whose "producers" on nodes are replica actors.
bool register_replica_job(const std::string& name, const std::type_info& job, replica_maker make,
                          std::string signature);

/// The training runtime: replicas (actors, local or on nodes), shard assignment, reduction,
/// recovery. One call at a time (a cluster's change waits for the step under way).
class trainer {
 public:
  trainer(std::vector<device> devices, config cfg, train_options o, std::string job,
          replica_maker make, std::string signature);
  /// Over a live cluster's members, following it between steps.
  trainer(const cluster& c, config cfg, train_options o, std::string job, replica_maker make,
          std::string signature);
  trainer(trainer&&) noexcept;
  trainer& operator=(trainer&&) noexcept;
  ~trainer();

  enum class mode : std::uint8_t { reduce, local };
  double step(batch samples, mode m);
  void average_parameters();
  std::vector<at::Tensor> parameters();
  /// Every replica's parameters, flattened (for checks that they agree), in device order.
  std::vector<at::Tensor> replica_parameters();
  void save(const std::string& path);
  void load(const std::string& path);
  void add_devices(const std::vector<device>& devices);
  void remove_devices(const std::vector<device>& devices);
  [[nodiscard]] std::vector<device> devices() const;
  [[nodiscard]] train_stats stats() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace detail

/// Data-parallel training of `Job` (a job with a nested `replica`) over devices.
template <class Job>
class data_parallel {
  using traits = detail::replica_traits<Job>;

 public:
  using sample_type = typename traits::sample_type;

  /// Constructs one replica per device (each on its device's own thread) and gives every replica
  /// replica 0's parameters and optimizer state. Throws invalid_argument, device_unavailable,
  /// init_error (a replica's constructor threw) or node_error.
  data_parallel(std::vector<device> devices, config cfg = {}, train_options o = {})
      : t_(std::move(devices), std::move(cfg), o, registered_job_name_of(),
           &detail::replica_impl<Job>::create, detail::replica_signature(typeid(sample_type))) {}
  /// One replica per device of the cluster's members that are up, following the cluster between
  /// steps (docs/api.md, "Pools that change"): a node that joins or rejoins (restarted) gets
  /// replicas at the next step boundary, given the current parameters and optimizer state; one
  /// drained by cluster::remove leaves between steps; one lost is recomputed as always. With
  /// `deterministic`, the parameters do not depend on any of it.
  data_parallel(const cluster& c, config cfg = {}, train_options o = {})
      : t_(c, std::move(cfg), o, registered_job_name_of(), &detail::replica_impl<Job>::create,
           detail::replica_signature(typeid(sample_type))) {}

  /// One synchronous step: the batch's shards spread over the replicas (faster ones take more),
  /// gradients of the batch's mean loss reduced once, replica::step() on every replica. Returns
  /// the batch's mean loss. A replica lost meanwhile: its shards are recomputed by the others in
  /// this step. Throws work_error (device, the shard's first sample) when a backward throws: no
  /// replica has stepped then.
  double step(const std::vector<sample_type>& samples) {
    return t_.step(batch::of(samples), detail::trainer::mode::reduce);
  }
  /// Each replica steps on the mean gradient of its own shards (an even split of the batch's
  /// shards in device order), without any reduction; returns the batch's mean loss.
  double local_step(const std::vector<sample_type>& samples) {
    return t_.step(batch::of(samples), detail::trainer::mode::local);
  }
  /// Every replica's parameters become their mean (summed in device order, once, and sent to
  /// all), behind a barrier.
  void average_parameters() { t_.average_parameters(); }
  /// A CPU copy of the parameters (replica 0's; every replica holds the same after step()).
  std::vector<at::Tensor> parameters() { return t_.parameters(); }
  /// Every replica's parameters, flattened, in device order (for checks).
  std::vector<at::Tensor> replica_parameters() { return t_.replica_parameters(); }
  /// Writes parameters and optimizer state (replica::optimizer() and replica::save, when the
  /// replica has them).
  void save(const std::string& path) { t_.save(path); }
  /// Reads what save() wrote into every replica.
  void load(const std::string& path) { t_.load(path); }
  /// Between steps: new replicas get the current parameters and optimizer state.
  void add_devices(const std::vector<device>& d) { t_.add_devices(d); }
  void remove_devices(const std::vector<device>& d) { t_.remove_devices(d); }
  /// The devices of the replicas in use.
  [[nodiscard]] std::vector<device> devices() const { return t_.devices(); }
  [[nodiscard]] train_stats stats() const { return t_.stats(); }

 private:
  static std::string registered_job_name_of() {
    ensure_batch_type<sample_type>();
    return detail::registered_job_name(typeid(Job));
  }
  detail::trainer t_;
};

template <class Job>
struct train_registrar<Job, std::enable_if_t<detail::has_replica<Job>::value>> {
  static bool reg(const char* name) {
    using sample = typename detail::replica_traits<Job>::sample_type;
    static_assert(caf::detail::is_serializable<sample>::value,
                  "troupe: a training job's samples must be serializable by CAF to reach "
                  "replicas on nodes: give them an inspect() overload");
    register_batch_type<sample>();
    return detail::register_replica_job(name, typeid(Job), &detail::replica_impl<Job>::create,
                                        detail::replica_signature(typeid(sample)));
  }
};

}  // namespace troupe
