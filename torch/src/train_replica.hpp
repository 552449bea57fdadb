// Data-parallel training: a replica's state (one per replica actor, on the actor's thread). Its
// model and gradients: train_replica.cpp; its commands and ring all-reduce:
// train_replica_actor.cpp.
#pragma once

#include <caf/event_based_actor.hpp>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <tuple>

#include "ring_plane.hpp"
#include "train_msg.hpp"
#include "troupe/device_binding.hpp"

namespace troupe::detail {

struct replica_state {
  device where;
  config cfg;
  replica_maker make = nullptr;
  std::unique_ptr<device_binding> binding;
  std::unique_ptr<replica_ops> r;
  std::vector<at::Tensor> params;
  at::Tensor local_grad;          ///< local mode: this replica's own gradient sum, until applied
  double local_divisor = 1;       ///< ... and its sample count
  at::Tensor sum_buf, shard_buf;  ///< gradient buffers reused from step to step
  at::Tensor applied;             ///< the update's gradient, which step() reads
  std::uint64_t buf_step = 0;     ///< the step whose sum sum_buf holds
  at::Tensor partial;             ///< ring: this replica's sum for step partial_step
  std::uint64_t partial_step = 0;

  /// A ring all-reduce in progress (see ring_start).
  struct ring_run {
    std::uint64_t reply_id = 0, id = 0;
    std::uint32_t pos = 0, n = 0, pieces = 0, done = 0;
    std::vector<std::uint32_t> hops;  ///< per piece
    caf::actor right, coordinator;
    at::Tensor buf;
    std::string key;                      ///< data plane: the ring's key, in hex
    std::unique_ptr<ring_plane::run> io;  ///< data plane: the ring's thread (joined on reset)
  } ring;
  /// Where the left neighbour connects for ring data (a CPU replica on a node served without
  /// TLS), else null: rings then go through CAF.
  std::unique_ptr<ring_plane::listener> plane;
  /// Chunks that arrived before their turn, by (ring id, piece, hop).
  std::map<std::tuple<std::uint64_t, std::uint32_t, std::uint32_t>, at::Tensor> early;
  std::set<std::string> connected;  ///< nodes this one has a direct connection to
  std::uint64_t failing_sample = 0;
  /// Per parameter, set by a hook of its own when a backward gives it a gradient: read after
  /// each backward request (train_msg::used). Shared with the hooks, which live on the
  /// replica's tensors and may outlive this state.
  std::shared_ptr<std::vector<std::uint8_t>> touched =
      std::make_shared<std::vector<std::uint8_t>>();
  /// local_step: this replica's own, for its own update.
  std::vector<std::uint8_t> local_used;

  /// Frees the replica, every tensor held here and then the device binding (idempotent; on
  /// the replica's thread, or in its actor's cleanup).
  void release() noexcept;
  void init(init_reply& out);

  // -- gradients as views of one flat tensor (as DDP's gradient_as_bucket_view): backward
  // accumulates straight into the flat tensor that is reduced, no copy into it afterwards.

  std::int64_t numel() const;
  /// `*slot` (kept from step to step: a fresh buffer of a large model pays its page faults every
  /// step) or, with no slot, a new tensor, the size of all parameters.
  at::Tensor flat_buffer(at::Tensor* slot);
  /// Elements [off, off + p.numel()) of `flat`, shaped like `p`: a tensor of its own over that
  /// memory (not an autograd view, which replica code's zero_grad() could not detach_()).
  static at::Tensor part_of(const at::Tensor& flat, std::int64_t off, const at::Tensor& p);
  /// Every parameter's grad becomes its part of `flat`.
  void bind(const at::Tensor& flat);
  /// After backward: a grad that replica code replaced (zero_grad() setting it to none, say) is
  /// copied into its part of `flat`.
  void gather(const at::Tensor& flat);
  /// Zeroes the gradients, runs backward on shard `s`, returns the flat gradient (in `*slot`,
  /// when given).
  at::Tensor shard_grad(const train_msg& m, std::uint64_t s, double& loss,
                        at::Tensor* slot = nullptr);
  void backward(const train_msg& m, train_msg& out);
  /// The parameters' gradients become `g / divisor`, in one pass, in a buffer that is this
  /// replica's alone (`g` may be another replica's answer, which others are reading).
  void set_grads(const at::Tensor& g, double divisor);
  void apply(const train_msg& m);
  void set_params(const std::vector<at::Tensor>& values);
  std::string state();
  void set_state(const at::Tensor& bytes);
  /// set_state's loads, in order (the parameters checked already).
  void load_state(torch::serialize::InputArchive& archive, const std::vector<at::Tensor>& values);
  static c10::Device torch_device_of(const device& d);

  // -- ring all-reduce: reduce-scatter then all-gather over n chunks of the partial sum; chunk
  // k is reduced once (by one replica) and then copied to all, so every replica ends with the
  // same bits. The buffer is cut into `pieces` slices, each all-reduced by a ring of its own, so
  // that one piece's next hop overlaps another's transfer. Hop h (0 .. 2n-3) of a piece
  // arrives from the left neighbour, in order (one sender).

  /// Pieces for a gradient of `bytes` among `n`: about 1 MiB per hop message, at most 8.
  static std::uint32_t ring_pieces(std::int64_t bytes, std::uint32_t n);
  at::Tensor chunk(std::uint32_t piece, std::uint32_t k);
  void ring_send(caf::event_based_actor* self, std::uint32_t piece, std::uint32_t hop,
                 std::uint32_t k);
  /// Takes the next hop of `piece`; returns true when the whole all-reduce is complete.
  bool ring_take(caf::event_based_actor* self, std::uint32_t piece, const at::Tensor& t);
  /// Takes the chunks that came before their turn; true when the all-reduce is complete.
  bool ring_drain(caf::event_based_actor* self);
  chunk_result ring_done(chunk_result r);
  /// Starts a ring over this step's partial sum; an answer when it is over already (or failed).
  std::optional<chunk_result> ring_start(caf::event_based_actor* self, const ring_order& o);
  /// Runs the ring that ring_start set up over the data plane: the bytes move on the ring's
  /// thread, which tells this actor when it is over (plane_done).
  void plane_start(caf::event_based_actor* self, const std::string& data, const std::string& key);
  /// The data plane's ring `id` is over: the answer to the coordinator, or nothing (a ring
  /// given up on, or a message that does not carry the ring's key).
  std::optional<chunk_result> plane_done(std::uint64_t id, const std::string& key, bool ok,
                                         const std::string& what);
  /// A ring chunk from the left neighbour (no answer to it; the coordinator hears when the
  /// ring is over).
  void take_chunk(caf::event_based_actor* self, const ring_chunk& c);

  /// A command (or a ring chunk); the answer, if it has one.
  std::optional<chunk_result> handle(caf::event_based_actor* self, const work_chunk& w);
};

}  // namespace troupe::detail
