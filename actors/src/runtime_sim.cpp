// A runtime on a simulated cluster (troupe::testing::simulation): the same runner, its producers
// spawned by the simulation, its scheduler on the simulation's thread; where a runtime waits,
// this one runs the simulation until what it waits for has happened.
#include <algorithm>
#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>
#include <optional>

#include "runtime_impl.hpp"
#include "troupe/error.hpp"
#include "troupe/log.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

namespace {

/// Asks every producer to construct its job object and records the answers (a simulation's
/// runtime cannot wait for them: the simulation runs until they are in).
caf::behavior init_collector(caf::event_based_actor* self, std::vector<caf::actor> producers,
                             std::shared_ptr<std::vector<std::optional<caf::error>>> answers) {
  for (std::size_t i = 0; i < producers.size(); ++i)
    self->request(producers[i], caf::infinite, init_atom::value)
        .then([answers, i](const init_done&) { (*answers)[i] = caf::error{}; },
              [answers, i](caf::error& err) { (*answers)[i] = std::move(err); });
  return {[](int) {}};
}

}  // namespace

runtime::runtime(std::shared_ptr<sim_host> sim, std::vector<device> devices, config cfg,
                 options opts, producer_maker make)
    : devices_(std::move(devices)),
      cfg_(std::move(cfg)),
      opts_(std::move(opts)),
      spawn_([make, host = sim.get(), wire = opts_.serialize](caf::actor_system&, const device& d,
                                                              const config& c, std::size_t i) {
        return host->spawn_producer(make, d, c, i, wire);
      }),
      stats_(std::make_shared<stats_box>()),
      sim_(std::move(sim)) {
  check_and_count();
  sys_ = &sim_->system();
  auto producers = start_simulated(devices_, 0);
  scheduler_ = spawn_scheduler(*sys_, std::move(producers), devices_, opts_, stats_, spawn_, cfg_,
                               /*detached=*/false, sim_->halted(), {}, sim_->planted());
  sim_->own(scheduler_);
  publish();
  open_ = true;
  gate_->rt = this;
  enlist();
}

std::vector<caf::actor> runtime::start_simulated(const std::vector<device>& ds, std::size_t first) {
  std::vector<caf::actor> producers;
  for (std::size_t i = 0; i < ds.size(); ++i)
    producers.push_back(spawn_(*sys_, ds[i], cfg_, first + i));
  auto answers = std::make_shared<std::vector<std::optional<caf::error>>>(producers.size());
  auto collector = sys_->spawn(init_collector, producers, answers);
  sim_->drive([&] {
    return std::all_of(answers->begin(), answers->end(), [](auto& a) { return a.has_value(); });
  });
  caf::anon_send_exit(collector, caf::exit_reason::user_shutdown);
  for (std::size_t i = 0; i < answers->size(); ++i) {
    auto& a = (*answers)[i];
    if (a && !*a) continue;
    for (auto& p : producers) caf::anon_send_exit(p, caf::exit_reason::user_shutdown);
    sim_->drive([] { return false; });
    auto name = ds[i].str() + " (producer " + std::to_string(first + i) + ")";
    if (!a) throw testing::hang("producer " + name + " never started");
    auto why = "producer " + name + ": " + error_text(*a);
    if (error_code(*a) == errc::node_error) throw node_error(why);
    throw init_error(why);
  }
  return producers;
}

void runtime::close_simulated() noexcept {
  try {
    if (!open_) return;
    open_ = false;
    auto promise = std::make_shared<std::promise<void>>();
    auto closed = promise->get_future().share();
    // timed: the scheduler keeps close_timeout itself, in virtual time.
    caf::anon_send(scheduler_, close_atom::value, std::move(promise), true);
    sim_->drive(
        [&] { return closed.wait_for(std::chrono::seconds{0}) == std::future_status::ready; });
  } catch (const std::exception& e) {
    log(log_level::error, std::string{"closing a simulated runner failed: "} + e.what());
  }
}

}  // namespace troupe::detail
