// Data-parallel training: the replica actor (train_replica.hpp's state behind the runner's
// producer protocol), its commands, and the ring all-reduce among replicas (through CAF or the
// data plane, ring_plane.hpp).
#include "train_replica.hpp"
#include "troupe/detail/network.hpp"
#include "troupe/internal/bulk.hpp"
#include "troupe/internal/registry.hpp"
#include "troupe/log.hpp"

namespace troupe::detail {
namespace {

/// A replica's ring over the data plane ended (to itself, from the ring's thread): ring id, key,
/// ok, what went wrong.
using ring_io_atom = caf::atom_constant<caf::atom("tr_ringio")>;

[[maybe_unused]] const bool train_msg_registered =
    (register_batch_type<train_msg>("troupe.train_msg"),
     register_batch_type<init_reply>("troupe.init_reply"),
     register_batch_type<ring_chunk>("troupe.ring_chunk"), true);

}  // namespace

// -- ring all-reduce (train_replica.hpp) ----------------------------------------------------------

std::uint32_t replica_state::ring_pieces(std::int64_t bytes, std::uint32_t n) {
  auto per_hop = bytes / std::max<std::int64_t>(1, n);
  return static_cast<std::uint32_t>(std::clamp<std::int64_t>(per_hop >> 20, 1, 8));
}

at::Tensor replica_state::chunk(std::uint32_t piece, std::uint32_t k) {
  auto [b, e] = ring_plane::chunk_range(ring.buf.numel(), ring.pieces, ring.n, piece, k);
  return ring.buf.slice(0, b, e);
}

void replica_state::ring_send(caf::event_based_actor* self, std::uint32_t piece, std::uint32_t hop,
                              std::uint32_t k) {
  // A neighbour in this process reads the chunk where it is: the kernels that wrote it must
  // have finished (on a GPU they are queued on this replica's stream).
  if (binding) binding->synchronize();
  auto b = bulk::split_for(
      self, ring.right,
      batch::of(std::vector<ring_chunk>{ring_chunk{ring.id, piece, hop, chunk(piece, k)}}));
  self->send(ring.right, work_chunk{ring.id, hop, std::move(b), false});
}

bool replica_state::ring_take(caf::event_based_actor* self, std::uint32_t piece,
                              const at::Tensor& t) {
  const ring_plane::schedule plan{ring.n, ring.pos};
  const auto h = ring.hops[piece];
  auto c = chunk(piece, plan.received(h));
  if (t.numel() != c.numel()) throw protocol_error("a ring chunk of the wrong size");
  if (plan.adds(h))
    c.add_(t.to(c.device(), c.scalar_type()));  // reduce-scatter
  else
    c.copy_(t);  // all-gather
  ++ring.hops[piece];
  if (plan.passes_on(h)) ring_send(self, piece, h + 1, plan.sent(h + 1));
  if (ring.hops[piece] == plan.hops()) ++ring.done;
  return ring.done == ring.pieces;
}

bool replica_state::ring_drain(caf::event_based_actor* self) {
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

chunk_result replica_state::ring_done(chunk_result r) {
  if (r.ok()) r.outputs = batch::of(std::vector<train_msg>{train_msg{}});
  return r;
}

std::optional<chunk_result> replica_state::ring_start(caf::event_based_actor* self,
                                                      const ring_order& o) {
  chunk_result res;
  res.run = o.reply;
  try {
    if (o.n < 2 || o.pos >= o.n || !o.right) throw protocol_error("a malformed ring");
    ring_plane::die_at_test_ring();
    if (ring_plane::take_test_failure())
      throw protocol_error(std::string{"a ring made to fail by a test ("} +
                           (o.data.empty() ? "through CAF" : "over the data plane") + ")");
    ring = ring_run{};  // the last ring's thread is gone before its buffer is touched
    if (partial_step != o.attempt || !partial.defined()) {  // no shard of this step came here
      partial = flat_buffer(&sum_buf).zero_();
      partial_step = o.attempt;
      buf_step = o.attempt;
    }
    early.erase(early.begin(), early.lower_bound({o.ring, 0, 0}));  // chunks of rings given up
    ring.reply_id = o.reply;
    ring.id = o.ring;
    ring.pos = o.pos;
    ring.n = o.n;
    ring.coordinator = caf::actor_cast<caf::actor>(self->current_sender());
    ring.buf = partial;
    ring.pieces =
        ring_pieces(partial.numel() * static_cast<std::int64_t>(partial.element_size()), o.n);
    if (!o.data.empty()) {
      plane_start(self, o.data, o.key);
      return std::nullopt;
    }
    const auto& address = o.address;
    if (!address.empty() && connected.count(address) == 0) {
      // A direct connection to the neighbour's node: otherwise CAF routes through the
      // coordinator, and the ring would load it as much as a star. Tried once per neighbour; it
      // is an optimization, not a condition: when it fails (two nodes of a ring connecting to
      // each other at once, a busy peer), the chunks take CAF's route and the ring goes on: an
      // error thrown here must not turn rings off for the rest of the run.
      connected.insert(address);
      try {
        connect_node(self->system(), address, tls_for(address), std::chrono::seconds{5}, nullptr);
      } catch (const std::exception& e) {
        log(log_level::info, std::string{"ring all-reduce: no direct connection to "} + address +
                                 " (" + e.what() + "); its chunks go through CAF's route");
      }
    }
    ring.right = o.right;
    ring.hops.assign(ring.pieces, 0);
    for (std::uint32_t p = 0; p < ring.pieces; ++p) ring_send(self, p, 0, o.pos);
    if (ring_drain(self)) return ring_done(res);
  } catch (const std::exception& e) {
    ring = ring_run{};
    res.code = errc::node_error;
    res.what = std::string{"ring all-reduce: "} + e.what();
    return res;
  }
  return std::nullopt;
}

void replica_state::plane_start(caf::event_based_actor* self, const std::string& data,
                                const std::string& key) {
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

std::optional<chunk_result> replica_state::plane_done(std::uint64_t id, const std::string& key,
                                                      bool ok, const std::string& what) {
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

void replica_state::take_chunk(caf::event_based_actor* self, const ring_chunk& c) {
  if (!c.data.defined() || c.piece > 64) return;
  const auto piece = c.piece, hop = c.hop;
  if (c.ring != ring.id || !ring.buf.defined()) {
    if (c.ring > ring.id) early[{c.ring, piece, hop}] = c.data;
    return;  // a ring that has not started here yet, or one given up
  }
  chunk_result res;
  res.run = ring.reply_id;
  try {
    if (piece >= ring.pieces || hop != ring.hops[piece])
      throw protocol_error("ring chunks out of order");
    if (!ring_take(self, piece, c.data) && !ring_drain(self)) return;
    res = ring_done(res);
  } catch (const std::exception& e) {
    res.code = errc::node_error;
    res.what = std::string{"ring all-reduce: "} + e.what();
  }
  auto to = ring.coordinator;
  if (!res.ok()) ring = ring_run{};
  self->send(to, res);
}

// -- the replica actor ----------------------------------------------------------------------------

std::optional<chunk_result> replica_state::handle(caf::event_based_actor* self,
                                                  const work_chunk& w) {
  chunk_result res;
  res.run = w.run;
  res.first = w.first;
  train_msg* m = nullptr;
  batch joined;
  try {
    joined = bulk::resolve(w.items);
    if (auto* c = joined.as<ring_chunk>(); c != nullptr && c->items.size() == 1) {
      if (r) take_chunk(self, c->items[0]);
      return std::nullopt;  // no answer: the coordinator hears when the ring is over
    }
    auto* b = joined.as<train_msg>();
    if (b == nullptr || b->items.size() != 1) throw protocol_error("not a training command");
    m = &b->items[0];
    if (m->samples) m->samples = bulk::resolve(m->samples);
  } catch (const std::exception& e) {
    res.code = errc::protocol_error;
    res.what = e.what();
    return res;
  }
  train_msg out;
  out.code = m->code;
  auto code = static_cast<op>(m->code);
  try {
    if (code != op::init && !r) throw protocol_error("replica on " + where.str() + " not started");
    switch (code) {
      case op::init: {
        init_reply ready;
        init(ready);
        res.outputs = batch::of(std::vector<init_reply>{std::move(ready)});
        return res;
      }
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

namespace {

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
      [self, st](const ring_order& o) {
        mark_internal_thread();
        if (auto r = st->ring_start(self, o))
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

}  // namespace

caf::actor spawn_replica(caf::actor_system& sys, const device& d, const config& cfg,
                         replica_maker make) {
  auto st = std::make_shared<replica_state>();
  st->where = d;
  st->cfg = cfg;
  st->make = make;
  return sys.spawn<caf::detached>(replica_actor, st);
}

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

}  // namespace troupe::detail
