// Data-parallel training: a replica's model and gradients (train_replica.hpp): starting it,
// backward into one flat gradient buffer, applying an update, its parameters and saved state.
#include "train_replica.hpp"

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <mutex>
#include <sstream>

#include "troupe/detail/network.hpp"
#include "troupe/log.hpp"

namespace troupe::detail {

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

void replica_state::release() noexcept {
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

void replica_state::init(init_reply& out) {
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
    if (!p.defined()) throw invalid_argument("replica::parameters() returned an undefined tensor");
    if (p.scalar_type() != params[0].scalar_type())
      throw invalid_argument(
          "replica::parameters() mixes dtypes: troupe reduces them as one flat tensor");
    if (p.device() != params[0].device())
      throw invalid_argument(
          "replica::parameters() are on several devices: troupe reduces them as one flat "
          "tensor");
  }
  touched->assign(params.size(), 0);
  for (std::size_t i = 0; i < params.size(); ++i)
    if (params[i].requires_grad())
      params[i].register_hook([t = touched, i](const at::Tensor&) {
        if (i < t->size()) (*t)[i] = 1;
      });
  out.device = where.str();
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
  out.grad_bytes = numel * static_cast<std::uint64_t>(params[0].element_size());
  out.data_port = static_cast<std::uint16_t>(port);
  // Whether the replica's state beyond its parameters travels (the coordinator warns when one
  // without it joins a run).
  out.carries_state = r->carries_state();
}

// -- gradients as views of one flat tensor (train_replica.hpp) ------------------------------------

std::int64_t replica_state::numel() const {
  std::int64_t n = 0;
  for (auto& p : params) n += p.numel();
  return n;
}

at::Tensor replica_state::flat_buffer(at::Tensor* slot) {
  auto n = numel();
  if (slot == nullptr) return at::empty({n}, params[0].options());
  if (!slot->defined() || slot->numel() != n) *slot = at::empty({n}, params[0].options());
  return *slot;
}

at::Tensor replica_state::part_of(const at::Tensor& flat, std::int64_t off, const at::Tensor& p) {
  auto* data =
      static_cast<char*>(flat.data_ptr()) + off * static_cast<std::int64_t>(flat.element_size());
  return at::from_blob(
      data, p.sizes(), [keep = flat](void*) mutable { keep = at::Tensor{}; }, flat.options());
}

void replica_state::bind(const at::Tensor& flat) {
  std::int64_t off = 0;
  for (auto& p : params) {
    auto* want =
        static_cast<char*>(flat.data_ptr()) + off * static_cast<std::int64_t>(flat.element_size());
    if (!p.grad().defined() || p.grad().data_ptr() != want)
      p.mutable_grad() = part_of(flat, off, p);
    off += p.numel();
  }
}

void replica_state::gather(const at::Tensor& flat) {
  std::int64_t off = 0;
  for (auto& p : params) {
    auto* want =
        static_cast<char*>(flat.data_ptr()) + off * static_cast<std::int64_t>(flat.element_size());
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

at::Tensor replica_state::shard_grad(const train_msg& m, std::uint64_t s, double& loss,
                                     at::Tensor* slot) {
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

void replica_state::backward(const train_msg& m, train_msg& out) {
  auto start = clock::now();
  out.losses.assign(m.end_shard - m.first_shard, 0.0);
  std::fill(touched->begin(), touched->end(), 0);
  auto mode = static_cast<reduction>(m.mode);
  if (m.attempt != buf_step && m.attempt != partial_step) {
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
    bool reuse = m.attempt != buf_step;
    buf_step = m.attempt;
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
      if (partial_step == m.attempt && partial.defined()) {
        partial.add_(acc);
      } else {
        partial = acc;
        partial_step = m.attempt;
        ring = ring_run{};  // a new step: whatever ring was under way is given up
        early.clear();
      }
    } else {
      out.tensors.push_back(acc.cpu());
    }
  }
  if (binding) binding->synchronize();
  out.used = *touched;
  if (mode == reduction::local) local_used = *touched;
  out.busy_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - start).count();
}

void replica_state::set_grads(const at::Tensor& g, double divisor) {
  if (g.numel() != numel()) throw protocol_error("a gradient of the wrong size");
  auto dst = flat_buffer(&applied);
  auto src = g.to(dst.device(), dst.scalar_type());
  at::div_out(dst, src, at::scalar_tensor(divisor, dst.options()));
  bind(dst);
  // A frozen parameter (requires_grad false) has no gradient, as in a plain loop: LibTorch's
  // optimizers skip a parameter whose grad is undefined, but apply weight decay and momentum to
  // a zero one (a frozen backbone under AdamW moved by 2.4e-4 in a few steps).
  for (auto& p : params)
    if (!p.requires_grad()) p.mutable_grad() = at::Tensor{};
}

void replica_state::apply(const train_msg& m) {
  const auto* used = &m.used;
  if (static_cast<reduction>(m.mode) == reduction::local) {
    if (!local_grad.defined()) return;  // no shard this step
    set_grads(local_grad, local_divisor);
    local_grad = at::Tensor{};
    used = &local_used;  // its own shards alone
  } else if (static_cast<reduction>(m.mode) == reduction::ring) {
    if (!ring.buf.defined() || ring.pieces == 0 || ring.done != ring.pieces)
      throw protocol_error("apply before the ring all-reduce finished");
    set_grads(ring.buf, m.divisor);
    ring = ring_run{};
  } else {
    if (m.tensors.size() != 1) throw protocol_error("apply without a gradient");
    set_grads(m.tensors[0], m.divisor);
  }
  // A parameter no shard of the step used gets no gradient, as in a plain loop (and as DDP
  // does for parameters unused on every rank): a zero one, weight decay, momentum and Adam's
  // moments moved.
  if (used->size() == params.size())
    for (std::size_t i = 0; i < params.size(); ++i)
      if ((*used)[i] == 0) params[i].mutable_grad() = at::Tensor{};
  r->step();
  if (binding) binding->synchronize();
}

void replica_state::set_params(const std::vector<at::Tensor>& values) {
  if (values.size() != params.size())
    throw protocol_error("parameters of another model (" + std::to_string(values.size()) +
                         " tensors, this replica has " + std::to_string(params.size()) + ")");
  for (std::size_t i = 0; i < params.size(); ++i)  // all checked before any is changed
    if (!values[i].defined() || values[i].numel() != params[i].numel())
      throw protocol_error("parameters of another model (tensor " + std::to_string(i) + " has " +
                           std::to_string(values[i].defined() ? values[i].numel() : 0) +
                           " elements, this replica's " + std::to_string(params[i].numel()) + ")");
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params.size(); ++i)
    params[i].copy_(values[i].view(params[i].sizes()));
}

std::string replica_state::state() {
  torch::serialize::OutputArchive archive;
  for (std::size_t i = 0; i < params.size(); ++i)
    archive.write("param." + std::to_string(i), params[i].detach().cpu());
  if (auto* opt = r->optimizer()) {
    torch::serialize::OutputArchive o;
    opt->save(o);
    archive.write("optimizer", o);
  }
  torch::serialize::OutputArchive own;
  if (r->save(own)) archive.write("replica", own);
  std::ostringstream bytes;
  archive.save_to(bytes);
  return bytes.str();
}

namespace {

std::string shape_of(const at::Tensor& t) {
  std::string out = "[";
  for (auto d : t.sizes()) out += (out.size() > 1 ? ", " : "") + std::to_string(d);
  return out + "]";
}

/// The first line of an exception's text (LibTorch's carry a C++ backtrace after it).
std::string first_line(const std::exception& e) {
  std::string w = e.what();
  return w.substr(0, w.find('\n'));
}

}  // namespace

void replica_state::set_state(const at::Tensor& bytes) {
  torch::serialize::InputArchive archive;
  archive.load_from(static_cast<const char*>(bytes.data_ptr()),
                    static_cast<std::size_t>(bytes.numel()), torch_device_of(where));
  // A checkpoint of another model is refused before anything changes: as many tensors, each of
  // this replica's shape (not only as many elements: a transposed weight loaded silently).
  std::vector<at::Tensor> values(params.size());
  for (std::size_t i = 0; i < params.size(); ++i)
    if (!archive.try_read("param." + std::to_string(i), values[i]) || !values[i].defined())
      throw invalid_argument("a checkpoint of another model (it has " + std::to_string(i) +
                             " parameter tensors, this replica " + std::to_string(params.size()) +
                             ")");
  if (at::Tensor more; archive.try_read("param." + std::to_string(params.size()), more))
    throw invalid_argument("a checkpoint of another model (it has more than the " +
                           std::to_string(params.size()) + " parameter tensors of this replica)");
  for (std::size_t i = 0; i < params.size(); ++i)
    if (values[i].sizes() != params[i].sizes())
      throw invalid_argument("a checkpoint of another model (its tensor " + std::to_string(i) +
                             " is " + shape_of(values[i]) + ", this replica's " +
                             shape_of(params[i]) + ")");
  // The optimizer's state and the replica's own can only be tried: what this replica holds now
  // is put back when either load throws (another optimizer, other parameter groups), so that a
  // refused checkpoint leaves it as it was.
  auto before = state();
  try {
    load_state(archive, values);
  } catch (const std::exception& e) {
    try {
      torch::serialize::InputArchive again;
      again.load_from(before.data(), before.size(), torch_device_of(where));
      std::vector<at::Tensor> old(params.size());
      for (std::size_t i = 0; i < params.size(); ++i)
        again.read("param." + std::to_string(i), old[i]);
      load_state(again, old);
    } catch (...) {
      throw invalid_argument("the checkpoint does not fit this replica (" + first_line(e) +
                             "), and its state could not be put back");
    }
    throw invalid_argument(
        "the checkpoint does not fit this replica (another optimizer, other parameter groups "
        "or another replica type?), which is left as it was: " +
        first_line(e));
  }
}

void replica_state::load_state(torch::serialize::InputArchive& archive,
                               const std::vector<at::Tensor>& values) {
  set_params(values);
  torch::serialize::InputArchive o;
  if (auto* opt = r->optimizer(); opt != nullptr && archive.try_read("optimizer", o)) {
    // Replaced, not merged: Optimizer::load overwrites only the entries the archive holds, so
    // a replica's own momentum or Adam moments survived a checkpoint taken before its first
    // step (a rollback; the copy after local_step), and its updates then differed.
    opt->state().clear();
    opt->load(o);
  }
  torch::serialize::InputArchive own;
  if (archive.try_read("replica", own)) r->load(own);
}

c10::Device replica_state::torch_device_of(const device& d) {
  return d.is_cuda()
             ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(std::max(0, d.index())))
             : c10::Device(c10::kCPU);
}

}  // namespace troupe::detail
