// Data-parallel training: replica actors (one thread each, on its device) and the coordinator
// that assigns shards, reduces gradients once, applies the same update everywhere, and
// recomputes a lost replica's shards on the survivors. Design notes: docs/api.md, "Training:
// data_parallel".
//
// Replicas speak the runner's producer protocol (work_chunk in, chunk_result out), with one
// train_msg as the chunk's only item: nodes spawn them through spawn_producer like any job's
// producer, and large tensors cross the network through the bulk path.
#include "troupe/train.hpp"

#include <ATen/ATen.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scoped_actor.hpp>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>
#include <type_traits>

#include "ring_plane.hpp"
#include "train_core.hpp"
#include "troupe/detail/cluster_state.hpp"
#include "troupe/detail/network.hpp"
#include "troupe/device_binding.hpp"
#include "troupe/internal/bulk.hpp"
#include "troupe/internal/registry.hpp"
#include "troupe/log.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {
namespace {

using clock = std::chrono::steady_clock;
/// A replica's ring over the data plane ended (to itself, from the ring's thread): ring id, key,
/// ok, what went wrong.
using ring_io_atom = caf::atom_constant<caf::atom("tr_ringio")>;

enum class op : std::uint8_t {
  init,
  backward,
  apply,
  get_params,
  set_params,
  get_state,
  set_state,
  ring_chunk,
};
/// fast: a partial sum per replica, summed by the coordinator; ring: partial sums kept by the
/// replicas and all-reduced among them in a ring (replicas on nodes, large gradients);
/// deterministic: a fixed tree over shard indices; local: every replica steps on its own.
enum class reduction : std::uint8_t { fast, deterministic, local, ring };

/// One command to a replica, or its answer.
struct train_msg {
  std::uint8_t code = 0;   ///< op
  std::uint8_t mode = 0;   ///< reduction (backward, apply)
  std::uint64_t step = 0;  ///< the coordinator's id of this attempt at a step (backward)
  std::uint64_t total_shards = 0;
  std::uint64_t first_shard = 0;
  std::uint64_t end_shard = 0;
  std::uint64_t shard_size = 0;
  std::uint64_t first_sample = 0;  ///< global index of samples[0]
  batch samples;
  std::vector<at::Tensor> tensors;   ///< gradients, parameters, a state archive (bytes)
  std::vector<std::uint64_t> nodes;  ///< deterministic: (level, index) of each gradient tensor
  std::vector<double> losses;        ///< per shard
  std::string text;                  ///< the replica's device (init)
  std::int64_t busy_ns = 0;
  double divisor = 1;  ///< apply: the gradient is the sum divided by this (on the replica)
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, train_msg& x) {
  return f(caf::meta::type_name("troupe.train_msg"), x.code, x.mode, x.step, x.total_shards,
           x.first_shard, x.end_shard, x.shard_size, x.first_sample, x.samples, x.tensors, x.nodes,
           x.losses, x.text, x.busy_ns, x.divisor);
}

[[maybe_unused]] const bool train_msg_registered =
    (register_batch_type<train_msg>("troupe.train_msg"), true);

// -- the fixed summation tree over shard indices (train_core.hpp), on tensors --------------------

using train_core::node_key;
using train_core::tree_top;

/// Adds y into x (x is the caller's to reuse).
at::Tensor add_into(at::Tensor x, at::Tensor y) {
  return x.add_(y);
}

/// The largest tree nodes inside [a, b), computed in shard order, for the coordinator.
template <class Leaf>
void tree_blocks(std::uint64_t a, std::uint64_t b, std::uint64_t shards, Leaf& leaf,
                 train_msg& out) {
  auto add = &add_into;
  for (auto [l, i] : train_core::tree_blocks(a, b, shards)) {
    out.tensors.push_back(train_core::tree_value<at::Tensor>(l, i, shards, leaf, add).cpu());
    out.nodes.push_back(static_cast<std::uint64_t>(l));
    out.nodes.push_back(i);
  }
}

at::Tensor tree_combine(int l, std::uint64_t i, std::uint64_t shards,
                        std::map<node_key, at::Tensor>& have) {
  auto add = &add_into;
  try {
    return train_core::tree_combine<at::Tensor>(l, i, shards, have, add);
  } catch (const train_core::missing_shard& e) {
    throw protocol_error(e.what());
  }
}

// -- the replica actor --------------------------------------------------------------------------

at::Tensor flat(const std::vector<at::Tensor>& xs) {
  std::vector<at::Tensor> parts;
  parts.reserve(xs.size());
  for (auto& x : xs) parts.push_back(x.reshape(-1));
  return at::cat(parts);
}

at::Tensor bytes_tensor(const std::string& s) {
  auto t = at::empty({static_cast<std::int64_t>(s.size())}, at::kByte);
  std::copy(s.begin(), s.end(), reinterpret_cast<char*>(t.data_ptr()));
  return t;
}

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

  /// Frees the replica, every tensor held here and then the device binding (idempotent; on
  /// the replica's thread, or in its actor's cleanup).
  void release() noexcept {
    try {
      ring = ring_run{};
      early.clear();
      params.clear();
      local_grad = sum_buf = shard_buf = applied = partial = at::Tensor{};
      r.reset();
      plane.reset();
    } catch (...) {
    }
    binding.reset();
  }

  void init(train_msg& out) {
    binding = bind_device(where);
    {
      // The coordinator starts one replica per process at a time; this lock also covers
      // replicas of several data_parallel objects (or coordinators) started at once.
      static std::mutex constructing;
      std::lock_guard<std::mutex> lock{constructing};
      r = make(where, cfg);
    }
    params = r->parameters();
    if (params.empty()) throw invalid_argument("replica::parameters() returned no tensor");
    for (auto& p : params) {
      if (!p.defined())
        throw invalid_argument("replica::parameters() returned an undefined tensor");
      if (p.scalar_type() != params[0].scalar_type())
        throw invalid_argument(
            "replica::parameters() mixes dtypes: troupe reduces them as one flat tensor");
      if (p.device() != params[0].device())
        throw invalid_argument(
            "replica::parameters() are on several devices: troupe reduces them as one flat "
            "tensor");
    }
    out.text = where.str();
    std::uint64_t numel = 0;
    for (auto& p : params) numel += static_cast<std::uint64_t>(p.numel());
    std::uint64_t port = 0;
    if (auto host = plain_serve_host(); !host.empty() && params[0].is_cpu()) {
      try {
        plane = std::make_unique<ring_plane::listener>(host);
        port = plane->port();
      } catch (const std::exception& e) {
        log(log_level::warn, std::string{e.what()} + "; ring data goes through CAF");
      }
    }
    out.nodes = {numel * static_cast<std::uint64_t>(params[0].element_size()), port};
  }

  // -- gradients as views of one flat tensor (as DDP's gradient_as_bucket_view): backward
  // accumulates straight into the flat tensor that is reduced, no copy into it afterwards.

  std::int64_t numel() const {
    std::int64_t n = 0;
    for (auto& p : params) n += p.numel();
    return n;
  }

  /// `*slot` (kept from step to step: a fresh buffer of a large model pays its page faults every
  /// step) or, with no slot, a new tensor, the size of all parameters.
  at::Tensor flat_buffer(at::Tensor* slot) {
    auto n = numel();
    if (slot == nullptr) return at::empty({n}, params[0].options());
    if (!slot->defined() || slot->numel() != n) *slot = at::empty({n}, params[0].options());
    return *slot;
  }

  /// Elements [off, off + p.numel()) of `flat`, shaped like `p`: a tensor of its own over that
  /// memory (not an autograd view, which replica code's zero_grad() could not detach_()).
  static at::Tensor part_of(const at::Tensor& flat, std::int64_t off, const at::Tensor& p) {
    auto* data =
        static_cast<char*>(flat.data_ptr()) + off * static_cast<std::int64_t>(flat.element_size());
    return at::from_blob(
        data, p.sizes(), [keep = flat](void*) mutable { keep = at::Tensor{}; }, flat.options());
  }

  /// Every parameter's grad becomes its part of `flat`.
  void bind(const at::Tensor& flat) {
    std::int64_t off = 0;
    for (auto& p : params) {
      auto* want = static_cast<char*>(flat.data_ptr()) +
                   off * static_cast<std::int64_t>(flat.element_size());
      if (!p.grad().defined() || p.grad().data_ptr() != want)
        p.mutable_grad() = part_of(flat, off, p);
      off += p.numel();
    }
  }

  /// After backward: a grad that replica code replaced (zero_grad() setting it to none, say) is
  /// copied into its part of `flat`.
  void gather(const at::Tensor& flat) {
    std::int64_t off = 0;
    for (auto& p : params) {
      auto* want = static_cast<char*>(flat.data_ptr()) +
                   off * static_cast<std::int64_t>(flat.element_size());
      const auto& g = p.grad();
      if (!g.defined() || g.data_ptr() != want) {
        auto v = part_of(flat, off, p);
        if (g.defined())
          v.copy_(g);
        else
          v.zero_();
        p.mutable_grad() = v;
      }
      off += p.numel();
    }
  }

  /// Zeroes the gradients, runs backward on shard `s`, returns the flat gradient (in `*slot`,
  /// when given).
  at::Tensor shard_grad(const train_msg& m, std::uint64_t s, double& loss,
                        at::Tensor* slot = nullptr) {
    auto flat = flat_buffer(slot);
    flat.zero_();
    bind(flat);
    auto begin = s * m.shard_size;
    auto end = std::min(begin + m.shard_size, m.first_sample + m.samples.size());
    failing_sample = begin;
    loss = r->backward(m.samples, begin - m.first_sample, end - m.first_sample);
    gather(flat);
    return flat;
  }

  void backward(const train_msg& m, train_msg& out) {
    auto start = clock::now();
    out.losses.assign(m.end_shard - m.first_shard, 0.0);
    auto mode = static_cast<reduction>(m.mode);
    if (m.step != buf_step && m.step != partial_step) {
      // A new step (or the coordinator redoing one after a ring broke): whatever ring was under
      // way is given up, so that its late chunks cannot add into the buffers this step reuses.
      ring = ring_run{};
      early.clear();
    }
    if (mode == reduction::deterministic) {
      auto leaf = [&](std::uint64_t s) { return shard_grad(m, s, out.losses[s - m.first_shard]); };
      tree_blocks(m.first_shard, m.end_shard, m.total_shards, leaf, out);
    } else {
      // Into buffers of this replica's own: the coordinator reads the sum (and may add the
      // others' into it) before it sends this step's update, and this replica writes them again
      // only in the next step's backward, which comes after that update.
      // A second request of the same step (shards of a lost replica) gets fresh tensors: the
      // coordinator may still hold the first answer's sum.
      bool reuse = m.step != buf_step;
      buf_step = m.step;
      at::Tensor acc;
      for (auto s = m.first_shard; s < m.end_shard; ++s) {
        if (acc.defined())
          acc.add_(shard_grad(m, s, out.losses[s - m.first_shard], reuse ? &shard_buf : nullptr));
        else
          acc = shard_grad(m, s, out.losses[s - m.first_shard], reuse ? &sum_buf : nullptr);
      }
      if (mode == reduction::local) {
        auto n = std::min(m.end_shard * m.shard_size, m.first_sample + m.samples.size()) -
                 m.first_shard * m.shard_size;
        local_grad = acc;
        local_divisor = static_cast<double>(n);
      } else if (mode == reduction::ring) {
        if (partial_step == m.step && partial.defined()) {
          partial.add_(acc);
        } else {
          partial = acc;
          partial_step = m.step;
          ring = ring_run{};  // a new step: whatever ring was under way is given up
          early.clear();
        }
      } else {
        out.tensors.push_back(acc.cpu());
      }
    }
    if (binding) binding->synchronize();
    out.busy_ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - start).count();
  }

  /// The parameters' gradients become `g / divisor`, in one pass, in a buffer that is this
  /// replica's alone (`g` may be another replica's answer, which others are reading).
  void set_grads(const at::Tensor& g, double divisor) {
    if (g.numel() != numel()) throw protocol_error("a gradient of the wrong size");
    auto dst = flat_buffer(&applied);
    auto src = g.to(dst.device(), dst.scalar_type());
    at::div_out(dst, src, at::scalar_tensor(divisor, dst.options()));
    bind(dst);
  }

  void apply(const train_msg& m) {
    if (static_cast<reduction>(m.mode) == reduction::local) {
      if (!local_grad.defined()) return;  // no shard this step
      set_grads(local_grad, local_divisor);
      local_grad = at::Tensor{};
    } else if (static_cast<reduction>(m.mode) == reduction::ring) {
      if (!ring.buf.defined() || ring.pieces == 0 || ring.done != ring.pieces)
        throw protocol_error("apply before the ring all-reduce finished");
      set_grads(ring.buf, m.divisor);
      ring = ring_run{};
    } else {
      if (m.tensors.size() != 1) throw protocol_error("apply without a gradient");
      set_grads(m.tensors[0], m.divisor);
    }
    r->step();
    if (binding) binding->synchronize();
  }

  void set_params(const std::vector<at::Tensor>& values) {
    if (values.size() != params.size())
      throw protocol_error("parameters of another model (" + std::to_string(values.size()) +
                           " tensors, this replica has " + std::to_string(params.size()) + ")");
    for (std::size_t i = 0; i < params.size(); ++i)  // all checked before any is changed
      if (!values[i].defined() || values[i].numel() != params[i].numel())
        throw protocol_error("parameters of another model (tensor " + std::to_string(i) + " has " +
                             std::to_string(values[i].defined() ? values[i].numel() : 0) +
                             " elements, this replica's " + std::to_string(params[i].numel()) +
                             ")");
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params.size(); ++i)
      params[i].copy_(values[i].view(params[i].sizes()));
  }

  std::string state() {
    torch::serialize::OutputArchive archive;
    for (std::size_t i = 0; i < params.size(); ++i)
      archive.write("param." + std::to_string(i), params[i].detach().cpu());
    torch::serialize::OutputArchive own;
    if (r->save(own)) archive.write("replica", own);
    std::ostringstream bytes;
    archive.save_to(bytes);
    return bytes.str();
  }

  void set_state(const at::Tensor& bytes) {
    torch::serialize::InputArchive archive;
    archive.load_from(static_cast<const char*>(bytes.data_ptr()),
                      static_cast<std::size_t>(bytes.numel()), torch_device_of(where));
    std::vector<at::Tensor> values(params.size());
    for (std::size_t i = 0; i < params.size(); ++i)
      archive.read("param." + std::to_string(i), values[i]);
    set_params(values);
    torch::serialize::InputArchive own;
    if (archive.try_read("replica", own)) r->load(own);
  }

  static c10::Device torch_device_of(const device& d) {
    return d.is_cuda()
               ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(std::max(0, d.index())))
               : c10::Device(c10::kCPU);
  }

  // -- ring all-reduce: reduce-scatter then all-gather over n chunks of the partial sum; chunk
  // k is reduced once (by one replica) and then copied to all, so every replica ends with the
  // same bits. The buffer is cut into `pieces` slices, each all-reduced by a ring of its own, so
  // that one piece's next hop overlaps another's transfer. Hop h (0 .. 2n-3) of a piece
  // arrives from the left neighbour, in order (one sender).

  /// Pieces for a gradient of `bytes` among `n`: about 1 MiB per hop message, at most 8.
  static std::uint32_t ring_pieces(std::int64_t bytes, std::uint32_t n) {
    auto per_hop = bytes / std::max<std::int64_t>(1, n);
    return static_cast<std::uint32_t>(std::clamp<std::int64_t>(per_hop >> 20, 1, 8));
  }

  at::Tensor chunk(std::uint32_t piece, std::uint32_t k) {
    auto [b, e] = ring_plane::chunk_range(ring.buf.numel(), ring.pieces, ring.n, piece, k);
    return ring.buf.slice(0, b, e);
  }

  void ring_send(caf::event_based_actor* self, std::uint32_t piece, std::uint32_t hop,
                 std::uint32_t k) {
    // A neighbour in this process reads the chunk where it is: the kernels that wrote it must
    // have finished (on a GPU they are queued on this replica's stream).
    if (binding) binding->synchronize();
    train_msg m;
    m.code = static_cast<std::uint8_t>(op::ring_chunk);
    m.first_shard = piece;
    m.tensors.push_back(chunk(piece, k));
    auto b = bulk::split_for(self, ring.right, batch::of(std::vector<train_msg>{std::move(m)}));
    self->send(ring.right, work_chunk{ring.id, hop, std::move(b), false});
  }

  /// Takes the next hop of `piece`; returns true when the whole all-reduce is complete.
  bool ring_take(caf::event_based_actor* self, std::uint32_t piece, const at::Tensor& t) {
    const auto n = ring.n, h = ring.hops[piece];
    if (h < n - 1) {  // reduce-scatter: add, pass on (the last one starts the all-gather)
      auto k = (ring.pos + 2 * n - h - 1) % n;
      auto c = chunk(piece, k);
      if (t.numel() != c.numel()) throw protocol_error("a ring chunk of the wrong size");
      c.add_(t.to(c.device(), c.scalar_type()));
      ++ring.hops[piece];
      ring_send(self, piece, h + 1, k);
    } else {  // all-gather: copy, pass on
      auto g = h - (n - 1);
      auto k = (ring.pos + 2 * n - g) % n;
      auto c = chunk(piece, k);
      if (t.numel() != c.numel()) throw protocol_error("a ring chunk of the wrong size");
      c.copy_(t);
      ++ring.hops[piece];
      if (g + 1 < n - 1) ring_send(self, piece, h + 1, k);
    }
    if (ring.hops[piece] == 2 * (n - 1)) ++ring.done;
    return ring.done == ring.pieces;
  }

  /// Takes the chunks that came before their turn; true when the all-reduce is complete.
  bool ring_drain(caf::event_based_actor* self) {
    for (bool took = true; took;) {
      took = false;
      for (std::uint32_t p = 0; p < ring.pieces; ++p) {
        auto it = early.find({ring.id, p, ring.hops[p]});
        if (it == early.end()) continue;
        auto t = std::move(it->second);
        early.erase(it);
        took = true;
        if (ring_take(self, p, t)) return true;
      }
    }
    return false;
  }

  chunk_result ring_done(chunk_result r) {
    if (r.ok()) r.outputs = batch::of(std::vector<train_msg>{train_msg{}});
    return r;
  }

  /// Starts a ring over this step's partial sum; an answer when it is over already (or failed).
  std::optional<chunk_result> ring_start(caf::event_based_actor* self, std::uint64_t reply_id,
                                         std::uint64_t id, std::uint64_t step, std::uint32_t pos,
                                         std::uint32_t n, const caf::actor& right,
                                         const std::string& address, const std::string& data,
                                         const std::string& key) {
    chunk_result res;
    res.run = reply_id;
    try {
      if (n < 2 || pos >= n || !right) throw protocol_error("a malformed ring");
      if (ring_plane::take_test_failure())
        throw protocol_error(std::string{"a ring made to fail by a test ("} +
                             (data.empty() ? "through CAF" : "over the data plane") + ")");
      ring = ring_run{};  // the last ring's thread is gone before its buffer is touched
      if (partial_step != step || !partial.defined()) {  // no shard of this step came here
        partial = flat_buffer(&sum_buf).zero_();
        partial_step = step;
        buf_step = step;
      }
      early.erase(early.begin(), early.lower_bound({id, 0, 0}));  // chunks of rings given up
      ring.reply_id = reply_id;
      ring.id = id;
      ring.pos = pos;
      ring.n = n;
      ring.coordinator = caf::actor_cast<caf::actor>(self->current_sender());
      ring.buf = partial;
      ring.pieces =
          ring_pieces(partial.numel() * static_cast<std::int64_t>(partial.element_size()), n);
      if (!data.empty()) {
        plane_start(self, data, key);
        return std::nullopt;
      }
      if (!address.empty() && connected.count(address) == 0) {
        // A direct connection to the neighbour's node: otherwise CAF routes through the
        // coordinator, and the ring would load it as much as a star.
        connect_node(self->system(), address, tls_for(address), std::chrono::seconds{5}, nullptr);
        connected.insert(address);
      }
      ring.right = right;
      ring.hops.assign(ring.pieces, 0);
      for (std::uint32_t p = 0; p < ring.pieces; ++p) ring_send(self, p, 0, pos);
      if (ring_drain(self)) return ring_done(res);
    } catch (const std::exception& e) {
      ring = ring_run{};
      res.code = errc::node_error;
      res.what = std::string{"ring all-reduce: "} + e.what();
      return res;
    }
    return std::nullopt;
  }

  /// Runs the ring that ring_start set up over the data plane: the bytes move on the ring's
  /// thread, which tells this actor when it is over (plane_done).
  void plane_start(caf::event_based_actor* self, const std::string& data, const std::string& key) {
    if (!plane) throw protocol_error("a ring over the data plane, which this replica has not");
    auto to = parse_host_port(data);
    ring.key = key;
    ring_plane::spec sp;
    sp.id = ring.id;
    sp.secret = ring_plane::from_hex(key);
    sp.pos = ring.pos;
    sp.n = ring.n;
    sp.pieces = ring.pieces;
    sp.right_host = to.host;
    sp.right_port = to.port;
    sp.buf = ring.buf;
    caf::actor_addr me = self->address();
    auto id = ring.id;
    ring.io = std::make_unique<ring_plane::run>(
        *plane, std::move(sp), [me, id, key](bool ok, const std::string& what) {
          if (auto a = caf::actor_cast<caf::actor>(me))
            caf::anon_send(a, ring_io_atom::value, id, key, ok, what);
        });
  }

  /// The data plane's ring `id` is over: the answer to the coordinator, or nothing (a ring
  /// given up on, or a message that does not carry the ring's key).
  std::optional<chunk_result> plane_done(std::uint64_t id, const std::string& key, bool ok,
                                         const std::string& what) {
    if (!ring.io || ring.id != id || ring.key != key) return std::nullopt;
    ring.io.reset();  // its thread has ended, or is about to
    chunk_result res;
    res.run = ring.reply_id;
    if (ok) {
      ring.done = ring.pieces;
      return ring_done(res);
    }
    res.code = errc::node_error;
    res.what = "ring all-reduce: " + what;
    ring = ring_run{};
    return res;
  }

  /// A ring chunk from the left neighbour (no answer to it; the coordinator hears when the
  /// ring is over).
  void ring_chunk(caf::event_based_actor* self, const work_chunk& w, train_msg& m) {
    if (m.tensors.size() != 1 || m.first_shard > 64) return;
    auto piece = static_cast<std::uint32_t>(m.first_shard);
    auto hop = static_cast<std::uint32_t>(w.first);
    if (w.run != ring.id || !ring.buf.defined()) {
      if (w.run > ring.id) early[{w.run, piece, hop}] = m.tensors[0];
      return;  // a ring that has not started here yet, or one given up
    }
    chunk_result res;
    res.run = ring.reply_id;
    try {
      if (piece >= ring.pieces || hop != ring.hops[piece])
        throw protocol_error("ring chunks out of order");
      if (!ring_take(self, piece, m.tensors[0]) && !ring_drain(self)) return;
      res = ring_done(res);
    } catch (const std::exception& e) {
      res.code = errc::node_error;
      res.what = std::string{"ring all-reduce: "} + e.what();
    }
    auto to = ring.coordinator;
    if (!res.ok()) ring = ring_run{};
    self->send(to, res);
  }

  /// A command (or a ring chunk); the answer, if it has one.
  std::optional<chunk_result> handle(caf::event_based_actor* self, const work_chunk& w) {
    chunk_result res;
    res.run = w.run;
    res.first = w.first;
    train_msg* m = nullptr;
    batch joined;
    try {
      joined = bulk::resolve(w.items);
      auto* b = joined.as<train_msg>();
      if (b == nullptr || b->items.size() != 1) throw protocol_error("not a training command");
      m = &b->items[0];
      if (m->samples) m->samples = bulk::resolve(m->samples);
    } catch (const std::exception& e) {
      res.code = errc::protocol_error;
      res.what = e.what();
      return res;
    }
    if (static_cast<op>(m->code) == op::ring_chunk) {
      if (r) ring_chunk(self, w, *m);
      return std::nullopt;
    }
    train_msg out;
    out.code = m->code;
    auto code = static_cast<op>(m->code);
    try {
      if (code != op::init && !r)
        throw protocol_error("replica on " + where.str() + " not started");
      switch (code) {
        case op::init:
          init(out);
          break;
        case op::backward:
          backward(*m, out);
          break;
        case op::apply:
          apply(*m);
          break;
        case op::get_params:
          for (auto& p : params) out.tensors.push_back(p.detach().cpu().clone());
          break;
        case op::set_params:
          set_params(m->tensors);
          break;
        case op::get_state:
          out.tensors.push_back(bytes_tensor(state()));
          break;
        case op::set_state:
          if (m->tensors.size() != 1) throw protocol_error("set_state without a state");
          set_state(m->tensors[0]);
          break;
        default:
          throw protocol_error("unknown training command");
      }
    } catch (...) {
      res.code = code == op::init ? errc::init_error : errc::work_error;
      res.failed_index = code == op::backward ? failing_sample : 0;
      res.what = describe_current_exception();
      // Which call failed, where it is not the step's backward (whose index says the shard).
      static const std::map<op, const char*> names{{op::apply, "step(): "},
                                                   {op::get_params, "reading the parameters: "},
                                                   {op::set_params, "setting the parameters: "},
                                                   {op::get_state, "saving the state: "},
                                                   {op::set_state, "loading the state: "}};
      if (auto it = names.find(code); it != names.end()) res.what = it->second + res.what;
      return res;
    }
    res.outputs = batch::of(std::vector<train_msg>{std::move(out)});
    return res;
  }
};

caf::behavior replica_actor(caf::event_based_actor* self, std::shared_ptr<replica_state> st) {
  self->attach_functor([st] { st->release(); });
  return {
      [self, st](const work_chunk& w) {
        mark_internal_thread();
        auto r = st->handle(self, w);
        if (!r) return;
        auto to = caf::actor_cast<caf::actor>(self->current_sender());
        if (r->ok()) r->outputs = bulk::split_for(self, to, r->outputs);
        self->send(to, std::move(*r));
      },
      [self, st](ring_atom, std::uint64_t reply_id, std::uint64_t id, std::uint64_t step,
                 std::uint32_t pos, std::uint32_t n, const caf::actor& right,
                 const std::string& address, const std::string& data, const std::string& key) {
        mark_internal_thread();
        if (auto r = st->ring_start(self, reply_id, id, step, pos, n, right, address, data, key))
          self->send(caf::actor_cast<caf::actor>(self->current_sender()), std::move(*r));
      },
      [self, st](ring_io_atom, std::uint64_t id, const std::string& key, bool ok,
                 const std::string& what) {
        auto to = st->ring.coordinator;
        if (auto r = st->plane_done(id, key, ok, what)) self->send(to, std::move(*r));
      },
      [self, st](release_atom) {
        st->release();
        self->send(caf::actor_cast<caf::actor>(self->current_sender()), release_atom::value);
        self->quit();
      },
      [](const bulk::fragment&) {},  // joined while it was deserialized
  };
}

caf::actor spawn_replica(caf::actor_system& sys, const device& d, const config& cfg,
                         replica_maker make) {
  auto st = std::make_shared<replica_state>();
  st->where = d;
  st->cfg = cfg;
  st->make = make;
  return sys.spawn<caf::detached>(replica_actor, st);
}

double seconds(clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

/// The actor system of every data_parallel over local devices only. Never destroyed (like the
/// runners' local system): a replica stuck inside backward() is left behind when its
/// data_parallel goes, instead of blocking that destructor until backward() returns.
caf::actor_system& training_system() {
  static caf::actor_system* sys = [] {
    auto* cfg = make_system_config(false).release();  // lives as long as the system: forever
    return new caf::actor_system(*cfg);
  }();
  return *sys;
}

}  // namespace

std::string replica_signature(const std::type_info& sample) {
  return "replica of " + batch_type_name(sample);
}

bool register_replica_job(const std::string& name, const std::type_info& job, replica_maker make,
                          std::string signature) {
  return register_job(
      name, job,
      [make](caf::actor_system& sys, const device& d, const config& cfg, std::size_t) {
        return spawn_replica(sys, d, cfg, make);
      },
      std::move(signature));
}

// -- the coordinator ----------------------------------------------------------------------------

struct trainer::impl {
  /// data_parallel built from a live cluster: the cluster's changes, applied between steps (a
  /// change waits for the step under way: `calls`). Registered before the trainer exists; the
  /// changes it hears until attach() are kept and applied then.
  struct follower final : cluster_follower {
    /// A change (or needs()) under way in the trainer: detach() waits for its end.
    struct in_use {
      const follower* f;
      ~in_use() {
        std::lock_guard<std::mutex> guard{f->mtx};
        f->busy -= 1;
        f->idle.notify_all();
      }
    };
    void on_event(const membership_event& e) override {
      impl* p = nullptr;
      {
        std::lock_guard<std::mutex> guard{mtx};
        if (!attached) {
          pending.push_back(e);
          return;
        }
        if (target == nullptr) return;
        p = target;
        busy += 1;
      }
      in_use done{this};
      p->follow_change(e);
    }
    [[nodiscard]] bool needs(const std::string& node) const override {
      impl* p = nullptr;
      {
        std::lock_guard<std::mutex> guard{mtx};
        if (target == nullptr) return false;
        p = target;
        busy += 1;
      }
      in_use done{this};
      return p->only_on(node);
    }
    void attach(impl* p) {
      std::lock_guard<std::mutex> guard{mtx};
      target = p;
      attached = true;
      for (auto& e : pending) {
        try {
          p->follow_change(e);
        } catch (const std::exception& x) {
          log(log_level::warn, std::string{"data_parallel could not follow its cluster ("} +
                                   to_string(e.what) + " of " + e.node + "): " + x.what());
        }
      }
      pending.clear();
    }
    void detach() noexcept {
      std::unique_lock<std::mutex> lock{mtx};
      target = nullptr;
      attached = true;
      pending.clear();
      idle.wait(lock, [this] { return busy == 0; });
    }
    mutable std::mutex mtx;
    mutable std::condition_variable idle;
    mutable std::size_t busy = 0;
    impl* target = nullptr;
    bool attached = false;
    std::vector<membership_event> pending;
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
  std::vector<member> members;
  std::uint64_t next_id = 1;
  train_stats stats;
  std::uint64_t grad_bytes = 0;  ///< of one replica's flat gradient
  bool ring_ok = true;           ///< false once a ring failed without a loss (no direct route)
  bool ring_timed_out = false;   ///< the last ring went past replica_timeout
  /// A ring that timed out while every replica answered on its own (a pause, a flood): the next
  /// ring_pause steps reduce through the coordinator; the pause doubles with every such ring
  /// (up to 256 steps) and is back to 1 after a ring that completes.
  std::uint64_t ring_pause = 1, ring_paused_until = 0;
  /// Rings among replicas that all have a data port use it; false once such a ring failed
  /// while no replica was lost (a port the others cannot reach): CAF's path from then on.
  bool plane_ok = true;
  bool plane_failed = false;  ///< the last ring was over the data plane and failed
  /// local_step() ran since the replicas' states were last the same: each optimizer stepped on
  /// its own gradients. The next step() first copies the first replica's state to the others.
  bool states_differ = false;
  /// Gradients at least this large, with a replica on a node, are all-reduced in a ring.
  static constexpr std::uint64_t ring_min_bytes = std::uint64_t{256} << 10;

  bool use_ring(const std::vector<std::size_t>& live) const {
    if (!ring_ok || live.size() < 2 || grad_bytes < ring_min_bytes) return false;
    if (stats.steps < ring_paused_until) return false;
    for (auto i : live)
      if (!members[i].d.is_local()) return true;
    return false;
  }

  /// All-reduces the live replicas' partial sums of step `attempt` in a ring. False when a
  /// replica was lost or failed meanwhile (the sums are then unusable).
  bool ring_all_reduce(std::uint64_t attempt) {
    ring_timed_out = false;
    plane_failed = false;
    auto ring = alive();
    if (ring.size() < 2) return false;
    auto id = next_id++;
    // The data plane when every member has a port (CPU replicas on nodes served without TLS).
    bool plane = plane_ok && o.direct_ring;
    for (auto i : ring) plane = plane && !members[i].d.is_local() && members[i].data_port != 0;
    auto key = plane ? ring_plane::to_hex(ring_plane::random_key()) : std::string{};
    std::map<std::uint64_t, pending> waiting;
    for (std::size_t k = 0; k < ring.size(); ++k) {
      auto& me = members[ring[k]];
      auto& right = members[ring[(k + 1) % ring.size()]];
      std::string address;  // a node-to-node hop needs a direct connection
      if (!plane && !me.d.is_local() && !right.d.is_local() && me.d.node() != right.d.node())
        address = right.d.node();
      std::string data;
      if (plane) {
        auto host = parse_host_port(right.d.node()).host;
        if (host.find(':') != std::string::npos) host = "[" + host + "]";
        data = host + ":" + std::to_string(right.data_port);
      }
      auto reply = next_id++;
      (*self)->send(me.a, ring_atom::value, reply, id, attempt, static_cast<std::uint32_t>(k),
                    static_cast<std::uint32_t>(ring.size()), right.a, address, data, key);
      waiting[reply] = pending{ring[k], clock::now(), 0, 0};
    }
    bool ok = true, lost = false;
    wait(
        waiting,
        [&](const pending&, chunk_result& r, train_msg&) {
          if (r.ok()) return;
          ok = false;
          waiting.clear();  // the others wait for chunks that will not come: give up on them
          if (plane) {
            // Most often a neighbour lost (its connection closed before the coordinator heard
            // of it): the step's recomputation tells (see step()).
            plane_failed = true;
            log(log_level::info, r.what + "; reducing this step through the coordinator");
          } else {
            log(log_level::warn, r.what + "; reducing through the coordinator from now on");
          }
        },
        [&](const pending&) {
          ok = false;
          lost = true;
          waiting.clear();
        },
        [&] {
          // replica_timeout inside the ring: every member's answer waits for the whole ring,
          // so lateness names no one. The step is computed again through the coordinator,
          // where a frozen replica's own request times out and only it is dropped.
          ok = false;
          ring_timed_out = true;
          waiting.clear();
          log(log_level::warn,
              "ring all-reduce past replica_timeout; reducing this step "
              "through the coordinator");
        });
    if (!ok && !lost && !ring_timed_out && !plane_failed) ring_ok = false;
    if (ok) {
      stats.ring_reductions += 1;
      ring_pause = 1;
    }
    if (ok && plane) stats.direct_ring_reductions += 1;
    return ok;
  }

  ~impl() {
    if (self) {
      // Local replicas free their tensors and device state before the destructor returns: a
      // program that ends right after it must not tear LibTorch's CUDA state down under a
      // replica thread still freeing them (a segfault at exit, seen on the GPU machine). Every
      // replica not given up on is retired: the live ones, and the removed or dropped ones
      // that were idle (a replica dropped as stuck was told to exit and is not waited for).
      std::vector<std::size_t> all(members.size());
      for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
      retire(all);
      if (owner) (*self)->send_exit(owner, caf::exit_reason::user_shutdown);
    }
    self.reset();
  }
  /// How long the destructor waits for local replicas to free what they hold.
  static constexpr std::chrono::seconds release_wait{5};

  std::vector<std::size_t> alive() const {
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < members.size(); ++i)
      if (members[i].alive) out.push_back(i);
    return out;
  }

  std::uint64_t send(std::size_t who, train_msg msg) {
    auto id = next_id++;
    auto b = batch::of(std::vector<train_msg>{std::move(msg)});
    auto& dest = members[who].a;
    b = bulk::split_for(self->ptr(), dest, b);
    (*self)->send(dest, work_chunk{id, 0, std::move(b), false});
    return id;
  }

  /// Takes `who` out of the step. Its actor is told to exit (`abandon`: it may be stuck, or is
  /// gone already), or, a local one that is idle, left to `retire` (which waits for it to free
  /// its tensors and device).
  void drop(std::size_t who, bool abandon = true) {
    auto& m = members[who];
    if (!m.alive) return;
    m.alive = false;
    m.st.lost = true;
    stats.lost_replicas += 1;
    (*self)->demonitor(m.a);
    if (abandon || !m.d.is_local()) {
      (*self)->send_exit(m.a, caf::exit_reason::user_shutdown);
      m.gone = true;
    }
  }

  /// Drops `who`, replicas that are idle (they answered), and retires them.
  void drop_idle(const std::vector<std::size_t>& who) {
    for (auto i : who) drop(i, /*abandon=*/false);
    retire(who);
  }

  /// Local replicas among `who` free everything they hold (waited for, at most release_wait
  /// for one still busy in user code, which is then left behind); the others are told to exit.
  void retire(const std::vector<std::size_t>& who) {
    std::set<caf::actor_addr> releasing;
    for (auto i : who) {
      auto& m = members[i];
      if (!m.a || m.gone) continue;
      m.gone = true;
      if (m.d.is_local()) {
        (*self)->send(m.a, release_atom::value);
        releasing.insert(m.a.address());
      } else {
        (*self)->send_exit(m.a, caf::exit_reason::user_shutdown);
      }
    }
    auto deadline = clock::now() + release_wait;
    bool late = false;
    while (!releasing.empty() && !late) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
      (*self)->receive(
          [&](release_atom) {
            releasing.erase(caf::actor_cast<caf::actor_addr>((*self)->current_sender()));
          },
          [&](caf::down_msg& dm) {
            releasing.erase(dm.source);
            // A live replica lost meanwhile (a node that died between steps): dropped here,
            // or the next step would wait for it forever, its down message consumed.
            for (std::size_t i = 0; i < members.size(); ++i)
              if (members[i].alive && members[i].a.address() == dm.source) drop(i);
          },
          [](chunk_result&) {}, [](const bulk::fragment&) {},
          caf::after(std::max(left, std::chrono::milliseconds{0})) >> [&] { late = true; });
    }
    for (auto i : who)
      if (members[i].a && releasing.count(members[i].a.address()) > 0)
        (*self)->send_exit(members[i].a, caf::exit_reason::user_shutdown);
  }

  /// Waits for every request in `waiting`: `on_reply(id, pending, result, msg)` for answers,
  /// `on_lost(pending)` for requests whose replica was lost (dropped first).
  /// With `replica_timeout`, requests older than it are lost (their replicas dropped), unless
  /// `on_late` is given: then it is called instead, and decides.
  template <class OnReply, class OnLost, class OnLate = std::nullptr_t>
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
        train_msg msg;
        if (r.ok()) {
          try {
            auto joined = bulk::resolve(r.outputs);
            auto* b = joined.as<train_msg>();
            if (b == nullptr || b->items.size() != 1) throw protocol_error("not a training answer");
            msg = std::move(b->items[0]);
          } catch (const std::exception& e) {
            r.code = errc::protocol_error;
            r.what = e.what();
          }
        }
        on_reply(p, r, msg);
      };
      auto on_down = [&](caf::down_msg& dm) {
        for (std::size_t i = 0; i < members.size(); ++i)
          if (members[i].alive && members[i].a.address() == dm.source) lose(i);
      };
      if (o.replica_timeout.count() > 0) {
        auto first = clock::time_point::max();
        for (auto& [id, p] : waiting) first = std::min(first, p.sent);
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            first + o.replica_timeout - clock::now());
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

  /// Sends `msg` to each of `who` and waits for all; returns the answers by member. Throws the
  /// first error (after every answer is in); lost members are dropped.
  /// `drop_failed`: when some (not all) of `who` fail, those are dropped (and retired) before
  /// the error is thrown, so that the others stay identical (a command that changes state).
  std::map<std::size_t, train_msg> everyone(const std::vector<std::size_t>& who,
                                            const train_msg& msg, bool drop_failed = false) {
    std::map<std::uint64_t, pending> waiting;
    for (auto w : who) waiting[send(w, msg)] = pending{w, clock::now(), 0, 0};
    std::map<std::size_t, train_msg> out;
    first_failure failure;
    std::vector<std::size_t> failed;
    wait(
        waiting,
        [&](const pending& p, chunk_result& r, train_msg& m) {
          if (!failure.failed(p, r))
            out[p.member] = std::move(m);
          else
            failed.push_back(p.member);
        },
        [](const pending&) {});
    if (drop_failed && !failed.empty() && !out.empty()) {
      drop_idle(failed);
    }
    if (failure.result) raise(*failure.result, failure.member);
    return out;
  }

  [[noreturn]] void raise(const chunk_result& r, std::size_t who) {
    auto where = members[who].d.str();
    if (r.code == errc::work_error) throw work_error(r.what, r.failed_index, where);
    throw_error(r.code, "replica on " + where + ": " + r.what);
  }

  caf::actor node_actor(const std::string& address) {
    if (auto it = nodes.find(address); it != nodes.end()) return it->second;
    auto a = connect_node(*sys, address, tls_for(address), std::chrono::seconds{5}, nullptr);
    nodes[address] = a;
    return a;
  }

  /// `fresh` in rounds that hold at most one replica per process (the caller's, or a node's):
  /// the k-th round holds the k-th replica of each process, in member order.
  std::vector<std::vector<std::size_t>> construction_rounds(const std::vector<std::size_t>& fresh) {
    std::map<std::string, std::size_t> seen;  // process ("" = this one) -> replicas so far
    std::vector<std::vector<std::size_t>> rounds;
    for (auto i : fresh) {
      auto k = seen[members[i].d.is_local() ? std::string{} : members[i].d.node()]++;
      if (rounds.size() <= k) rounds.resize(k + 1);
      rounds[k].push_back(i);
    }
    return rounds;
  }

  /// Spawns and starts replicas on `devices`; returns their member indexes.
  std::vector<std::size_t> start(const std::vector<device>& devices) {
    std::vector<std::size_t> fresh;
    for (auto& d : devices) {
      caf::actor a;
      if (d.is_local()) {
        if (auto why = why_unavailable(d); !why.empty()) throw device_unavailable(why);
        a = spawn_replica(*sys, d, cfg, make);
      } else {
        if (!networked)
          throw invalid_argument(
              "device " + d.str() +
              " is on a node, but this data_parallel was built over local devices only: name a "
              "node's device in the constructor's list to train over the network");
        if (job.empty())
          throw invalid_argument(
              "replicas on nodes need the job registered: TROUPE_REGISTER_JOB(...) in this program "
              "and the node's");
        auto n = node_actor(d.node());
        std::optional<caf::error> err;
        (*self)
            ->request(n, std::chrono::seconds{10},
                      spawn_producer{job, signature, d.local().str(), cfg, members.size()}, owner)
            .receive([&](caf::actor& r) { a = std::move(r); }, [&](caf::error& e) { err = e; });
        if (err)
          throw_error(error_code(*err) == errc::none ? errc::node_error : error_code(*err),
                      "cannot start a replica on " + d.str() + ": " + error_text(*err));
      }
      (*self)->monitor(a);
      member m;
      m.d = d;
      m.a = a;
      m.st.device = d.str();
      members.push_back(std::move(m));
      fresh.push_back(members.size() - 1);
    }
    train_msg init;
    init.code = static_cast<std::uint8_t>(op::init);
    try {
      // The replicas' constructors run one at a time in each process, in member order (replica
      // 0 first): a constructor that seeds torch's global generator and builds its model
      // (torch::manual_seed(s); net = Net();) must not have its draws interleaved with another
      // replica's. Processes differ in their generators, so each round starts the next replica
      // of every process at once.
      for (auto& round : construction_rounds(fresh))
        for (auto& [who, msg] : everyone(round, init)) {
          if (!msg.nodes.empty()) grad_bytes = msg.nodes[0];
          members[who].data_port =
              msg.nodes.size() > 1 ? static_cast<std::uint16_t>(msg.nodes[1]) : 0;
        }
    } catch (...) {
      // The replicas that started are idle: freed before the exception leaves (the one that
      // failed too; one stuck past replica_timeout was given up on already).
      drop_idle(fresh);
      throw;
    }
    for (auto i : fresh)
      if (!members[i].alive)
        throw node_error("replica on " + members[i].d.str() + " was lost while starting");
    return fresh;
  }

  /// Copies the state (parameters, optimizer) of the first live replica not in `to` into `to`.
  void copy_state(const std::vector<std::size_t>& to) {
    for (auto from : alive()) {
      if (std::find(to.begin(), to.end(), from) != to.end()) continue;
      train_msg get;
      get.code = static_cast<std::uint8_t>(op::get_state);
      auto got = everyone({from}, get);
      if (got.empty()) continue;  // lost meanwhile: the next one
      train_msg set;
      set.code = static_cast<std::uint8_t>(op::set_state);
      set.tensors = std::move(got.begin()->second.tensors);
      everyone(to, set);
      return;
    }
  }

  /// Splits shards [a, b) among `who` in proportion to their speed (even before it is known).
  /// When there are at least as many shards as replicas, each gets one before the rest is
  /// split: a replica measured slow once (a hiccup) would otherwise get none, and so never be
  /// measured again.
  /// Shards [a, b) among `who` by their measured speed (train_core::split).
  std::vector<std::pair<std::size_t, std::pair<std::uint64_t, std::uint64_t>>> split(
      std::uint64_t a, std::uint64_t b, const std::vector<std::size_t>& who, bool even) {
    std::vector<double> rates;
    for (auto i : who) rates.push_back(members[i].rate);
    std::vector<std::pair<std::size_t, std::pair<std::uint64_t, std::uint64_t>>> out;
    for (auto& x : train_core::split(a, b, who, rates, even)) out.push_back({x.who, {x.a, x.b}});
    return out;
  }

  double step(const batch& samples, mode m) {
    auto started = clock::now();
    const std::uint64_t n = samples.size();
    if (n == 0) throw invalid_argument("step() needs a batch with at least one sample");
    const std::uint64_t ss = o.shard_size;
    const std::uint64_t shards = (n + ss - 1) / ss;
    if (m == mode::local) {
      states_differ = true;
    } else if (states_differ) {
      auto live = alive();
      if (live.size() > 1) copy_state(std::vector<std::size_t>(live.begin() + 1, live.end()));
      states_differ = false;
    }
    auto red = m == mode::local ? reduction::local
                                : (o.deterministic ? reduction::deterministic : reduction::fast);
    auto live = alive();
    if (live.empty()) throw node_error("no replica left: every one was lost or removed");
    if (red == reduction::fast && use_ring(live)) red = reduction::ring;
    std::vector<double> losses(shards, 0.0);
    std::map<std::uint64_t, at::Tensor> partials;  // fast: by first shard
    std::map<node_key, at::Tensor> blocks;         // deterministic
    std::map<std::uint64_t, pending> waiting;
    std::vector<std::size_t> stepped;  // local: who holds a gradient
    std::uint64_t lost_samples = 0;    // local: of replicas lost with their update
    std::uint64_t attempt = next_id++;

    auto dispatch = [&](std::size_t who, std::uint64_t a, std::uint64_t b) {
      train_msg msg;
      msg.code = static_cast<std::uint8_t>(op::backward);
      msg.mode = static_cast<std::uint8_t>(red);
      msg.step = attempt;
      msg.total_shards = shards;
      msg.first_shard = a;
      msg.end_shard = b;
      msg.shard_size = ss;
      auto from = a * ss, to = std::min(n, b * ss);
      if (members[who].d.is_local()) {  // shared, not copied
        msg.samples = samples;
        msg.first_sample = 0;
      } else {
        msg.samples = samples.slice(from, to);
        msg.first_sample = from;
      }
      waiting[send(who, std::move(msg))] = pending{who, clock::now(), a, b};
    };
    first_failure failure;
    // Ring mode: the shards whose sum each replica holds (until the all-reduce, a replica's sum
    // exists only there).
    std::map<std::size_t, std::vector<std::pair<std::uint64_t, std::uint64_t>>> held;
    auto wait_backward = [&] {
      wait(
          waiting,
          [&](const pending& p, chunk_result& r, train_msg& msg) {
            if (failure.failed(p, r)) return;
            auto& mem = members[p.member];
            mem.st.shards += p.b - p.a;
            mem.st.busy_seconds += static_cast<double>(msg.busy_ns) * 1e-9;
            if (msg.busy_ns > 0) {
              double rate =
                  static_cast<double>(p.b - p.a) / (static_cast<double>(msg.busy_ns) * 1e-9);
              mem.rate = mem.rate > 0 ? 0.5 * mem.rate + 0.5 * rate : rate;
            }
            for (std::uint64_t s = p.a; s < p.b && s - p.a < msg.losses.size(); ++s)
              losses[s] = msg.losses[s - p.a];
            if (red == reduction::fast) {
              if (msg.tensors.size() == 1) partials[p.a] = msg.tensors[0];
            } else if (red == reduction::deterministic) {
              for (std::size_t k = 0; k < msg.tensors.size() && 2 * k + 1 < msg.nodes.size(); ++k)
                blocks[{static_cast<int>(msg.nodes[2 * k]), msg.nodes[2 * k + 1]}] = msg.tensors[k];
            } else if (red == reduction::local) {
              stepped.push_back(p.member);
            } else if (red == reduction::ring) {
              held[p.member].emplace_back(p.a, p.b);
            }
          },
          [&](const pending& p) {
            if (failure.result) return;
            if (red == reduction::local) {
              // That replica's own update is gone with it: its samples (the last shard may be
              // short) leave the mean loss.
              lost_samples += std::min(p.b * ss, n) - p.a * ss;
              return;
            }
            auto rest = alive();
            if (rest.empty()) return;
            stats.recomputed_shards += p.b - p.a;
            for (auto& [who, range] : split(p.a, p.b, rest, false))
              dispatch(who, range.first, range.second);
          });
    };
    auto compute = [&] {
      held.clear();
      for (auto& [who, range] : split(0, shards, alive(), red == reduction::local))
        dispatch(who, range.first, range.second);
      // A replica that answered and was lost before the others did took its sum along: its
      // shards go to the survivors, in the same step, until no such loss is left.
      for (bool again = true; again;) {
        again = false;
        wait_backward();
        if (failure.result) raise(*failure.result, failure.member);
        if (red != reduction::ring) break;
        auto rest = alive();
        if (rest.empty()) break;
        for (auto& [who, ranges] : held) {
          if (members[who].alive || ranges.empty()) continue;
          for (auto [a, b] : ranges) {
            stats.recomputed_shards += b - a;
            for (auto& [to, range] : split(a, b, rest, false))
              dispatch(to, range.first, range.second);
          }
          ranges.clear();
          again = true;
        }
      }
      if (alive().empty()) throw node_error("every replica was lost during the step");
    };
    compute();
    auto ring_start = clock::now();
    bool ringed = red == reduction::ring && ring_all_reduce(attempt);
    if (red == reduction::ring) stats.reduce_seconds += seconds(clock::now() - ring_start);
    if (red == reduction::ring && !ringed) {
      // A replica lost (or failing, or late) inside the ring: the partial sums are half
      // reduced. The whole step again, on the survivors, summed by the coordinator.
      red = reduction::fast;
      attempt = next_id++;
      std::fill(losses.begin(), losses.end(), 0.0);
      stats.recomputed_shards += shards;
      auto lost_before = stats.lost_replicas;
      compute();
      // A ring too slow although every replica answers on its own: a pause from rings.
      if (ring_timed_out && stats.lost_replicas == lost_before) {
        ring_paused_until = stats.steps + 1 + ring_pause;
        log(log_level::warn,
            "the next " + std::to_string(ring_pause) + " steps reduce through the coordinator");
        ring_pause = std::min<std::uint64_t>(ring_pause * 2, 256);
      }
      // A ring over the data plane that failed though no replica was lost: CAF's path from now
      // on (a data port the others cannot reach, say).
      if (plane_failed && stats.lost_replicas == lost_before) {
        plane_ok = false;
        log(log_level::warn,
            "a ring over the replicas' data ports failed while every replica answered; rings "
            "go through CAF from now on");
      }
    }

    auto reduce_start = clock::now();
    train_msg apply;
    apply.code = static_cast<std::uint8_t>(op::apply);
    apply.mode = static_cast<std::uint8_t>(red);
    std::vector<std::size_t> targets;
    if (red == reduction::local) {
      targets = stepped;
    } else if (red == reduction::ring) {
      apply.divisor = static_cast<double>(n);  // every replica holds the sum already
      targets = alive();
    } else {
      at::Tensor total;
      if (red == reduction::fast) {
        for (auto& [first, t] : partials) {
          if (total.defined())
            total.add_(t);
          else
            total = t;  // the replica's answer, ours alone now
        }
      } else {
        total = tree_combine(tree_top(shards), 0, shards, blocks);
      }
      apply.tensors.push_back(total);
      apply.divisor = static_cast<double>(n);
      targets = alive();
    }
    std::optional<std::pair<chunk_result, std::size_t>> apply_failure;
    std::map<std::uint64_t, pending> applying;
    for (auto w : targets)
      if (members[w].alive) applying[send(w, apply)] = pending{w, clock::now(), 0, 0};
    wait(
        applying,
        [&](const pending& p, chunk_result& r, train_msg&) {
          if (r.ok()) return;
          // This replica's step() threw after others applied theirs: it no longer matches them.
          if (!apply_failure) apply_failure.emplace(r, p.member);
          drop(p.member, /*abandon=*/false);  // idle: retired with the others
        },
        [](const pending&) {});
    auto done = clock::now();
    stats.reduce_seconds += seconds(done - reduce_start);
    if (apply_failure) {
      auto& [r, who] = *apply_failure;
      throw work_error("replica::step() threw on " + members[who].d.str() +
                           " (that replica is dropped; the others have stepped): " + r.what,
                       0, members[who].d.str());
    }
    stats.steps += 1;
    stats.shards += shards;
    stats.step_seconds += seconds(done - started);
    double sum = 0;
    for (auto l : losses) sum += l;
    auto counted = n > lost_samples ? n - lost_samples : 1;
    return sum / static_cast<double>(counted);
  }

  std::map<std::size_t, train_msg> get_params(const std::vector<std::size_t>& who) {
    train_msg get;
    get.code = static_cast<std::uint8_t>(op::get_params);
    return everyone(who, get);
  }
};

trainer::trainer(std::vector<device> devices, config cfg, train_options o, std::string job,
                 replica_maker make, std::string signature)
    : impl_(std::make_unique<impl>()) {
  if (devices.empty()) throw invalid_argument("data_parallel needs at least one device");
  if (o.shard_size == 0) throw invalid_argument("train_options::shard_size must be at least 1");
  if (o.replica_timeout.count() < 0)
    throw invalid_argument("train_options::replica_timeout must not be negative");
  auto& p = *impl_;
  p.cfg = std::move(cfg);
  p.o = o;
  p.job = std::move(job);
  p.make = make;
  p.signature = std::move(signature);
  std::string remote;
  for (auto& d : devices)
    if (!d.is_local()) remote = d.node();
  if (remote.empty()) {
    p.sys = &training_system();
  } else {
    p.networked = true;
    p.sys = &network_system(tls_for(remote));
  }
  p.self = std::make_unique<caf::scoped_actor>(*p.sys);
  // An argument, however useless: a spawn without one makes CAF 0.17.6 dereference a null
  // std::shared_ptr<std::tuple<>> (UBSan reports it).
  p.owner = p.sys->spawn(
      [](caf::event_based_actor*, bool) -> caf::behavior {
        // A draining node's notice (leaving_atom): its replicas are lost to this trainer when
        // the node stops, and recomputed as for any loss.
        return {[](std::uint8_t) {}, [](leaving_atom, const std::vector<caf::actor>&) {}};
      },
      true);
  auto fresh = p.start(devices);
  p.copy_state(std::vector<std::size_t>(fresh.begin() + 1, fresh.end()));
}

trainer::trainer(const cluster& c, config cfg, train_options o, std::string job, replica_maker make,
                 std::string signature) {
  auto f = std::make_shared<impl::follower>();
  auto snap = troupe::detail::follow(c.state(), f);
  if (snap.devices.empty())
    throw invalid_argument("the cluster has no member that is up: no device to train on");
  *this = trainer(std::move(snap.devices), std::move(cfg), o, std::move(job), make,
                  std::move(signature));
  impl_->cluster = c.state();
  impl_->follows = f;
  f->attach(impl_.get());
}

trainer::trainer(trainer&&) noexcept = default;
trainer& trainer::operator=(trainer&&) noexcept = default;
trainer::~trainer() {
  if (impl_ && impl_->follows) impl_->follows->detach();  // first: a change may be under way
}

void trainer::impl::follow_change(const membership_event& e) {
  std::lock_guard<std::recursive_mutex> guard{calls};
  auto on_node = [&] {
    std::vector<device> there;
    for (auto& m : members)
      if (m.alive && !m.d.is_local() && m.d.node() == e.node) there.push_back(m.d);
    return there;
  };
  switch (e.what) {
    case membership_event::joined:
    case membership_event::rejoined: {
      nodes.erase(e.node);  // a restarted node is another process: connect anew
      if (e.what == membership_event::rejoined)  // the old process's replicas are gone
        for (std::size_t i = 0; i < members.size(); ++i)
          if (members[i].alive && !members[i].d.is_local() && members[i].d.node() == e.node)
            drop(i);
      auto here = on_node();
      std::vector<device> fresh;
      for (auto& d : e.devices) {
        auto i = std::find(here.begin(), here.end(), d);
        if (i != here.end())
          here.erase(i);
        else
          fresh.push_back(d);
      }
      if (!fresh.empty()) add(fresh);
      return;
    }
    case membership_event::draining: {
      auto there = on_node();
      if (!there.empty()) remove(there);
      return;
    }
    case membership_event::lost:
      // Given up on by the cluster: its replicas are lost now (the next step does not wait for
      // them), whatever they answer later is not used.
      nodes.erase(e.node);
      for (std::size_t i = 0; i < members.size(); ++i)
        if (members[i].alive && !members[i].d.is_local() && members[i].d.node() == e.node) drop(i);
      return;
    case membership_event::drained:
      return;
  }
}

bool trainer::impl::only_on(const std::string& node) {
  std::lock_guard<std::recursive_mutex> guard{calls};
  bool any = false;
  for (auto& m : members) {
    if (!m.alive) continue;
    if (m.d.is_local() || m.d.node() != node) return false;
    any = true;
  }
  return any;
}

double trainer::step(batch samples, mode m) {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  return impl_->step(samples, m);
}

void trainer::average_parameters() {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  auto& p = *impl_;
  auto live = p.alive();
  if (live.empty()) throw node_error("no replica left: every one was lost or removed");
  auto got = p.get_params(live);
  std::vector<at::Tensor> mean;
  for (auto& [who, msg] : got) {  // device order
    if (mean.empty()) {
      for (auto& t : msg.tensors) mean.push_back(t.clone());
    } else {
      for (std::size_t i = 0; i < mean.size() && i < msg.tensors.size(); ++i)
        mean[i].add_(msg.tensors[i]);
    }
  }
  for (auto& t : mean) t.div_(static_cast<double>(got.size()));
  train_msg set;
  set.code = static_cast<std::uint8_t>(op::set_params);
  set.tensors = std::move(mean);
  p.everyone(p.alive(), set);
}

std::vector<at::Tensor> trainer::parameters() {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  auto& p = *impl_;
  for (auto who : p.alive()) {
    auto got = p.get_params({who});
    if (!got.empty()) return std::move(got.begin()->second.tensors);
  }
  throw node_error("no replica left: every one was lost or removed");
}

std::vector<at::Tensor> trainer::replica_parameters() {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  auto& p = *impl_;
  std::vector<at::Tensor> out;
  for (auto& [who, msg] : p.get_params(p.alive())) out.push_back(flat(msg.tensors));
  return out;
}

void trainer::save(const std::string& path) {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  auto& p = *impl_;
  for (auto who : p.alive()) {
    train_msg get;
    get.code = static_cast<std::uint8_t>(op::get_state);
    auto got = p.everyone({who}, get);
    if (got.empty()) continue;
    auto& bytes = got.begin()->second.tensors.at(0);
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(static_cast<const char*>(bytes.data_ptr()), bytes.numel());
    if (!out) throw invalid_argument("cannot write " + path);
    return;
  }
  throw node_error("no replica left: every one was lost or removed");
}

void trainer::load(const std::string& path) {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  auto& p = *impl_;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw invalid_argument("cannot read " + path);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  train_msg set;
  set.code = static_cast<std::uint8_t>(op::set_state);
  set.tensors.push_back(bytes_tensor(bytes));
  // A replica whose load failed may hold the new parameters and its old optimizer state.
  p.everyone(p.alive(), set, /*drop_failed=*/true);
  p.states_differ = false;
}

void trainer::add_devices(const std::vector<device>& devices) {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  impl_->add(devices);
}

void trainer::remove_devices(const std::vector<device>& devices) {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  impl_->remove(devices);
}

void trainer::impl::add(const std::vector<device>& devices) {
  auto& p = *this;
  auto fresh = p.start(devices);
  try {
    p.copy_state(fresh);
  } catch (...) {
    // The new replicas did not get the others' state: they leave before the exception does.
    p.drop_idle(fresh);
    throw;
  }
}

void trainer::impl::remove(const std::vector<device>& devices) {
  auto& p = *this;
  std::vector<std::size_t> removed;
  for (auto& d : devices) {
    bool found = false;
    for (std::size_t i = 0; i < p.members.size() && !found; ++i) {
      if (p.members[i].alive && p.members[i].d == d) {
        p.members[i].alive = false;
        (*p.self)->demonitor(p.members[i].a);
        removed.push_back(i);
        found = true;
      }
    }
    if (!found) {
      p.retire(removed);
      throw invalid_argument("no replica on " + d.str() + " to remove");
    }
  }
  p.retire(removed);  // between steps: idle, so a local one frees its tensors at once
}

std::vector<device> trainer::devices() const {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  std::vector<device> out;
  for (auto& m : impl_->members)
    if (m.alive) out.push_back(m.d);
  return out;
}

train_stats trainer::stats() const {
  std::lock_guard<std::recursive_mutex> guard{impl_->calls};
  auto s = impl_->stats;
  for (auto& m : impl_->members) s.replicas.push_back(m.st);
  return s;
}

}  // namespace troupe::detail
