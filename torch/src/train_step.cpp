// Data-parallel training, the coordinator's step (train_impl.hpp): the shell around
// train_coordinator (train_coordinator.hpp), which decides. Its commands go to the replicas'
// actors (shards to compute, a ring to all-reduce, the update to apply); their answers, their
// actors' deaths and the clock passing replica_timeout come back to it as events.
#include "ring_plane.hpp"
#include "train_impl.hpp"
#include "train_sums.hpp"
#include "troupe/detail/network.hpp"

namespace troupe::detail {
namespace {

using ns = std::chrono::nanoseconds;
using train_core::reduce_mode;

static_assert(static_cast<int>(reduce_mode::fast) == static_cast<int>(reduction::fast) &&
              static_cast<int>(reduce_mode::deterministic) ==
                  static_cast<int>(reduction::deterministic) &&
              static_cast<int>(reduce_mode::local) == static_cast<int>(reduction::local) &&
              static_cast<int>(reduce_mode::ring) == static_cast<int>(reduction::ring));

ns now_ns() {
  return std::chrono::duration_cast<ns>(clock::now().time_since_epoch());
}

}  // namespace

/// One step's commands carried to the replicas' actors, and what their answers hold.
struct trainer::impl::step_shell final : train_core::train_io {
  step_shell(impl& t, const batch& samples) : t(t), sums(t.next_id, samples, t.o.shard_size) {}

  std::uint64_t begin_attempt(reduce_mode m) override { return sums.begin(m); }

  std::uint64_t backward(std::size_t who, std::uint64_t a, std::uint64_t b) override {
    return t.send(who, sums.backward(a, b, t.members[who].d.is_local()));
  }

  void take(std::uint64_t, const train_core::share& x) override {
    auto& st = t.members[x.who].st;
    st.shards += x.b - x.a;
    st.busy_seconds += static_cast<double>(answer->busy_ns) * 1e-9;
    sums.take(*answer, x);
  }

  std::vector<std::uint64_t> ring(const std::vector<std::size_t>& ring, bool plane) override {
    auto id = t.next_id++;
    auto key = plane ? ring_plane::to_hex(ring_plane::random_key()) : std::string{};
    std::vector<std::uint64_t> ids;
    for (std::size_t k = 0; k < ring.size(); ++k) {
      auto& me = t.members[ring[k]];
      auto& right = t.members[ring[(k + 1) % ring.size()]];
      std::string address;  // a node-to-node hop needs a direct connection
      if (!plane && !me.d.is_local() && !right.d.is_local() && me.d.node() != right.d.node())
        address = right.d.node();
      std::string data;
      if (plane) {
        auto host = parse_host_port(right.d.node()).host;
        if (host.find(':') != std::string::npos) host = "[" + host + "]";
        data = host + ":" + std::to_string(right.data_port);
      }
      auto reply = t.next_id++;
      (*t.self)->send(
          me.a, ring_order{reply, id, sums.attempt, static_cast<std::uint32_t>(k),
                           static_cast<std::uint32_t>(ring.size()), right.a, address, data, key});
      ids.push_back(reply);
    }
    return ids;
  }

  void reduce() override { sums.reduce(); }

  std::uint64_t apply(std::size_t who) override { return t.send(who, sums.update_msg()); }

  void drop(std::size_t who, bool abandon) override { t.drop(who, abandon); }

  void log(bool warn, const std::string& line) override {
    troupe::log(warn ? log_level::warn : log_level::info, line);
  }

  impl& t;
  step_sums sums;
  train_msg* answer = nullptr;                     ///< the answer handed to the coordinator
  std::map<std::uint64_t, chunk_result> failures;  ///< failed answers, by request
};

double trainer::impl::step(const batch& samples, mode m) {
  if (samples.size() == 0) throw invalid_argument("step() needs a batch with at least one sample");
  if (!coordinator)
    coordinator.emplace(train_core::train_coordinator::options{
        std::chrono::duration_cast<ns>(o.replica_timeout), o.direct_ring});
  auto& c = *coordinator;
  if (c.sync_before(m == mode::local)) {
    auto live = alive();
    if (live.size() > 1) copy_state(std::vector<std::size_t>(live.begin() + 1, live.end()));
  }
  auto started = clock::now();
  step_shell shell{*this, samples};
  train_core::train_coordinator::step_input in;
  in.samples = samples.size();
  in.shard_size = o.shard_size;
  in.local = m == mode::local;
  in.deterministic = o.deterministic;
  in.steps_done = stats.steps;
  in.grad_bytes = grad_bytes;
  std::vector<train_core::replica_info> replicas;
  for (auto& x : members)
    replicas.push_back(train_core::replica_info{x.alive, x.d.is_local(), x.data_port != 0, x.rate});
  c.begin(in, std::move(replicas), now_ns(), shell);
  while (!c.finished()) {
    auto on_result = [&](chunk_result& r) {
      auto msg = answer_of(r);
      if (!r.ok()) shell.failures.emplace(r.run, r);
      shell.answer = &msg;
      c.answered(r.run, r.ok(), static_cast<double>(msg.busy_ns) * 1e-9, now_ns());
      shell.answer = nullptr;
    };
    auto on_down = [&](caf::down_msg& dm) {
      for (std::size_t i = 0; i < members.size(); ++i)
        if (members[i].alive && members[i].a.address() == dm.source) {
          drop(i);
          c.lost(i, now_ns());
        }
    };
    if (auto due = c.deadline()) {
      // Rounded up: a wait rounded down to 0 ms would poll until the deadline.
      auto left = std::chrono::ceil<std::chrono::milliseconds>(*due - now_ns());
      (*self)->receive(
          on_result, on_down, [](const bulk::fragment&) {},
          caf::after(std::max(left, std::chrono::milliseconds{0})) >> [&] { c.tick(now_ns()); });
    } else {
      (*self)->receive(on_result, on_down, [](const bulk::fragment&) {});
    }
  }
  for (std::size_t i = 0; i < members.size() && i < c.replicas().size(); ++i)
    members[i].rate = c.replicas()[i].rate;
  auto& counts = c.step_counts();
  stats.recomputed_shards += counts.recomputed_shards;
  stats.ring_reductions += counts.ring_reductions;
  stats.direct_ring_reductions += counts.direct_ring_reductions;
  stats.reduce_seconds += std::chrono::duration<double>(counts.reduce).count();
  auto& out = c.result();
  throw_if_lost(out);
  using end = train_core::train_coordinator::end;
  if (out.e == end::backward_failed) {
    // Named as the simulation names it (train_sim_step.cpp): the call, the device, the words.
    auto& f = shell.failures.at(out.id);
    auto where = members[out.who].d.str();
    if (f.code == errc::work_error)
      throw work_error("replica::backward threw on " + where + ": " + f.what, f.failed_index,
                       where);
    raise(f, out.who);
  }
  if (out.e == end::apply_failed)
    throw apply_failed(members[out.who].d.str(), shell.failures.at(out.id).what, alive().empty());
  stats.steps += 1;
  stats.shards += shell.sums.shards;
  stats.step_seconds += std::chrono::duration<double>(clock::now() - started).count();
  return shell.sums.mean_loss(counts.lost_samples);
}

}  // namespace troupe::detail
