#include "troupe/detail/runtime.hpp"

#include <algorithm>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/atom.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/sec.hpp>
#include <caf/send.hpp>
#include <map>

#include "troupe/error.hpp"
#include "troupe/log.hpp"
#include "troupe/messages.hpp"
#include "troupe/node.hpp"
#include "troupe/registry.hpp"

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<troupe::detail::run_spec>)

namespace troupe::detail {
namespace {

std::string entry_name(const std::vector<device>& devices, std::size_t i) {
  return devices[i].str() + " (producer " + std::to_string(i) + ")";
}

}  // namespace

namespace {

constexpr auto remote_reply_timeout = std::chrono::seconds{120};  // a remote producer's init
constexpr auto remote_end_timeout = std::chrono::seconds{5};

bool any_remote(const std::vector<device>& devices) {
  return std::any_of(devices.begin(), devices.end(), [](auto& d) { return !d.is_local(); });
}

}  // namespace

runtime::runtime(std::vector<device> devices, config cfg, options opts, std::string job,
                 const producer_spawner& spawn)
    : devices_(std::move(devices)),
      cfg_(std::move(cfg)),
      opts_(std::move(opts)),
      stats_(std::make_shared<stats_box>()) {
  if (devices_.empty())
    throw invalid_argument(
        "the device list is empty: pass troupe::cpus(n), troupe::gpus() "
        "or device specs such as {\"cpu\", \"cuda:0\"}");
  if (opts_.max_chunk_items == 0 || opts_.max_chunk_bytes == 0 || opts_.consumer_backlog == 0)
    throw invalid_argument(
        "options: max_chunk_items, max_chunk_bytes and consumer_backlog "
        "must be positive");
  for (auto& d : devices_)
    if (auto why = why_unavailable(d); !why.empty()) throw device_unavailable(why);
  bool network = any_remote(devices_);
  if (network && job.empty())
    throw invalid_argument(
        "remote devices need a registered job: add TROUPE_REGISTER_JOB(your_job) at namespace "
        "scope, in this program and in the nodes' programs");
  for (auto& d : devices_) stats_->value.producers.push_back(producer_stats{d, 0, {}, true});
  tls settings;
  for (auto& d : devices_)
    if (!d.is_local()) settings = tls_for(d.node());
  if (network) {
    sys_ = &network_system(settings);
  } else {
    sys_cfg_ = make_system_config(false);
    own_sys_ = std::make_unique<caf::actor_system>(*sys_cfg_);
    sys_ = own_sys_.get();
  }
  std::vector<caf::actor> spawned;
  try {
    spawned = spawn_all(job, settings, spawn);
  } catch (...) {
    shutdown({});
    throw;
  }
  std::vector<caf::actor> started;
  std::string failure;
  errc failure_code = errc::none;
  {
    caf::scoped_actor self{*sys_};
    // Every producer constructs its job object concurrently, on its own thread.
    std::vector<decltype(self->request(spawned[0], caf::infinite, init_atom::value))> replies;
    for (std::size_t i = 0; i < spawned.size(); ++i)
      replies.push_back(devices_[i].is_local()
                            ? self->request(spawned[i], caf::infinite, init_atom::value)
                            : self->request(spawned[i], remote_reply_timeout, init_atom::value));
    for (std::size_t i = 0; i < replies.size(); ++i) {
      replies[i].receive([&](const init_done&) { started.push_back(spawned[i]); },
                         [&](const caf::error& err) {
                           if (failure_code == errc::none) {
                             failure_code = error_code(err);
                             failure = error_text(err);
                             if (failure_code != errc::device_unavailable)
                               failure = "producer " + entry_name(devices_, i) + ": " + failure;
                           }
                         });
    }
    if (failure_code != errc::none) {
      for (auto& p : spawned)
        if (std::find(started.begin(), started.end(), p) == started.end())
          self->send_exit(p, caf::exit_reason::user_shutdown);
    }
  }
  spawned.clear();
  if (failure_code != errc::none) {
    shutdown(std::move(started));
    if (failure_code == errc::device_unavailable) throw device_unavailable(failure);
    if (failure_code == errc::node_error) throw node_error(failure);
    throw init_error(failure + "; the producers that did start were ended");
  }
  producers_ = std::move(started);
  scheduler_ = spawn_scheduler(*sys_, producers_, devices_, opts_, stats_);
  open_ = true;
  log(log_level::debug, "runner started with " + std::to_string(devices_.size()) + " producer(s)");
}

std::vector<caf::actor> runtime::spawn_all(const std::string& job, const tls& settings,
                                           const producer_spawner& spawn) {
  std::vector<caf::actor> spawned;
  std::map<std::string, caf::actor> nodes;
  caf::scoped_actor self{*sys_};
  auto stop_spawned = [&] {
    for (auto& p : spawned) self->send_exit(p, caf::exit_reason::user_shutdown);
  };
  for (auto& d : devices_) {
    if (d.is_local()) {
      spawned.push_back(spawn(*sys_, d, cfg_));
      continue;
    }
    if (!anchor_)  // remote producers live as long as this actor: the nodes monitor it
      anchor_ = sys_->spawn(
          [](caf::event_based_actor*, int) -> caf::behavior { return {[](int) {}}; }, 0);
    auto& node = nodes[d.node()];
    try {
      if (!node) node = connect_node(*sys_, d.node(), settings, std::chrono::seconds{5}, nullptr);
    } catch (...) {
      stop_spawned();
      throw;
    }
    caf::error failed;
    caf::actor producer;
    self->request(node, remote_reply_timeout,
                  spawn_producer{job, find_job(job).signature, d.local().str(), cfg_}, anchor_)
        .receive([&](caf::actor& p) { producer = std::move(p); },
                 [&](caf::error& err) { failed = std::move(err); });
    if (failed) {
      stop_spawned();
      auto why = "node " + d.node() + " cannot start a producer on " + d.local().str() + ": " +
                 error_text(failed);
      if (error_code(failed) == errc::device_unavailable) throw device_unavailable(why);
      throw node_error(why);
    }
    spawned.push_back(std::move(producer));
  }
  return spawned;
}

runtime::~runtime() {
  close();
}

void runtime::shutdown(std::vector<caf::actor> started) noexcept {
  bool stuck = false;  // a local producer never came back from work()
  try {
    {
      caf::scoped_actor self{*sys_};
      if (scheduler_) self->send_exit(scheduler_, caf::exit_reason::user_shutdown);
      auto known = stats();  // producers the scheduler gave up on get no end request
      for (std::size_t i = 0; i < started.size(); ++i) {
        bool alive = i >= known.producers.size() || known.producers[i].alive;
        bool local = started[i].node() == sys_->node();
        if (alive || local) {
          // A request to a dead node is never answered by CAF 0.17: bound the wait. A local
          // producer given up on (options::work_timeout) may still be inside work(): bound that
          // wait too, and leave it behind if it does not come back.
          auto timeout =
              local && alive ? caf::duration{caf::infinite} : caf::duration{remote_end_timeout};
          self->request(started[i], timeout, end_atom::value)
              .receive([](const consume_ack&) {},
                       [&](const caf::error& err) {
                         if (local && !alive && err == caf::sec::request_timeout) stuck = true;
                         log(log_level::warn, "ending producer " + entry_name(devices_, i) +
                                                  " failed: " + error_text(err));
                       });
        }
        self->send_exit(started[i], caf::exit_reason::user_shutdown);
      }
      if (anchor_) self->send_exit(anchor_, caf::exit_reason::user_shutdown);
    }
    // Every handle must be gone before ~actor_system, which waits for the actors to be destroyed.
    started.clear();
    scheduler_ = nullptr;
    anchor_ = nullptr;
    producers_.clear();
    if (stuck && own_sys_) {
      // ~actor_system would wait for the stuck producer forever: leave the system behind.
      log(log_level::warn,
          "a producer is still stuck inside work(); its thread and this runner's actor system "
          "are left running");
      (void)own_sys_.release();
      (void)sys_cfg_.release();
    }
    own_sys_.reset();  // waits for every actor to terminate (the network system stays)
    sys_cfg_.reset();
  } catch (const std::exception& e) {
    log(log_level::error, std::string{"shutting down the runner failed: "} + e.what());
  }
}

void runtime::close() noexcept {
  std::lock_guard<std::mutex> guard{mtx_};
  if (!open_) return;
  open_ = false;
  shutdown(std::move(producers_));
}

bool runtime::is_open() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return open_;
}

troupe::stats runtime::stats() const {
  std::lock_guard<std::mutex> guard{stats_->mtx};
  return stats_->value;
}

void runtime::run(std::shared_ptr<input_source> source, const consumer_spawner& spawn,
                  bool ordered) {
  std::lock_guard<std::mutex> guard{mtx_};
  if (!open_) throw runner_closed("run() after close(): create a new runner");
  auto consumer = spawn(*sys_, cfg_);
  auto stop_consumer = [&] { caf::anon_send_exit(consumer, caf::exit_reason::user_shutdown); };
  {
    caf::scoped_actor self{*sys_};
    caf::error failed;
    self->request(consumer, caf::infinite, init_atom::value)
        .receive([](const consume_ack&) {}, [&](caf::error& err) { failed = std::move(err); });
    if (failed) {
      stop_consumer();
      throw consumer_error(error_text(failed));
    }
  }
  auto spec = std::make_shared<run_spec>();
  spec->id = next_run_++;
  spec->source = std::move(source);
  spec->consumer = consumer;
  spec->ordered = ordered;
  auto done = spec->done.get_future();
  caf::anon_send(scheduler_, std::move(spec));
  try {
    done.get();
  } catch (...) {
    stop_consumer();
    throw;
  }
  stop_consumer();
}

}  // namespace troupe::detail
