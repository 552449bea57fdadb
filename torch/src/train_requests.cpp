// Data-parallel training, the coordinator's requests to its replicas (train_impl.hpp): sending,
// waiting for every answer, dropping lost or failed replicas and retiring them.
#include <set>

#include "train_impl.hpp"

namespace troupe::detail {

trainer::impl::~impl() {
  if (numbers) trainers().remove(numbers.get());
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

std::vector<std::size_t> trainer::impl::alive() const {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < members.size(); ++i)
    if (members[i].alive) out.push_back(i);
  return out;
}

std::uint64_t trainer::impl::send(std::size_t who, train_msg msg) {
  auto id = next_id++;
  auto b = batch::of(std::vector<train_msg>{std::move(msg)});
  auto& dest = members[who].a;
  b = bulk::split_for(self->ptr(), dest, b);
  (*self)->send(dest, work_chunk{id, 0, std::move(b), false});
  return id;
}

void trainer::impl::drop(std::size_t who, bool abandon) {
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

void trainer::impl::drop_idle(const std::vector<std::size_t>& who) {
  for (auto i : who) drop(i, /*abandon=*/false);
  retire(who);
}

void trainer::impl::retire(const std::vector<std::size_t>& who) {
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

template <class Answer>
std::map<std::size_t, Answer> trainer::impl::everyone(const std::vector<std::size_t>& who,
                                                      const train_msg& msg, bool drop_failed) {
  std::map<std::uint64_t, pending> waiting;
  for (auto w : who) waiting[send(w, msg)] = pending{w, clock::now(), 0, 0};
  std::map<std::size_t, Answer> out;
  first_failure failure;
  std::vector<std::size_t> failed;
  wait<Answer>(
      waiting,
      [&](const pending& p, chunk_result& r, Answer& m) {
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

template std::map<std::size_t, train_msg> trainer::impl::everyone<train_msg>(
    const std::vector<std::size_t>&, const train_msg&, bool);
template std::map<std::size_t, init_reply> trainer::impl::everyone<init_reply>(
    const std::vector<std::size_t>&, const train_msg&, bool);

[[noreturn]] void trainer::impl::raise(const chunk_result& r, std::size_t who) {
  auto where = members[who].d.str();
  if (r.code == errc::work_error) throw work_error(r.what, r.failed_index, where);
  throw_error(r.code, "replica on " + where + ": " + r.what);
}

std::map<std::size_t, train_msg> trainer::impl::get_params(const std::vector<std::size_t>& who) {
  train_msg get;
  get.code = static_cast<std::uint8_t>(op::get_params);
  return everyone(who, get);
}

}  // namespace troupe::detail
