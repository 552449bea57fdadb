#include <algorithm>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/atom.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/sec.hpp>
#include <caf/send.hpp>
#include <fstream>
#include <future>
#include <map>

#include "runtime_impl.hpp"
#include "troupe/detail/job_actors.hpp"
#include "troupe/error.hpp"
#include "troupe/internal/ask_node.hpp"
#include "troupe/internal/registry.hpp"
#include "troupe/log.hpp"
#include "troupe/node.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

/// Every check of a runner's options, in one place: invalid_argument naming the option.
void validate(const batching& b) {
  if (b.max_delay.count() < 0 || b.max_delay > std::chrono::hours{1})
    throw invalid_argument("batching::max_delay must be between 0 and 1 hour");
  for (auto n : b.preferred_sizes)
    if (n == 0 || n > b.max_items)
      throw invalid_argument("batching::preferred_sizes must be between 1 and max_items (" +
                             std::to_string(b.max_items) + ")");
}

void validate(const options& o) {
  if (o.max_chunk_items == 0 || o.max_chunk_bytes == 0 || o.consumer_backlog == 0)
    throw invalid_argument(
        "options: max_chunk_items, max_chunk_bytes and consumer_backlog must be positive");
  if (!(o.speculation_after >= 1.0))
    throw invalid_argument(
        "options::speculation_after must be at least 1 (a multiple of a chunk's expected time)");
  if (o.close_timeout.count() < 0 || o.work_timeout.count() < 0)
    throw invalid_argument("options: close_timeout and work_timeout must not be negative");
  if (o.target_chunk_time <= std::chrono::microseconds{0} ||
      o.target_chunk_time > std::chrono::hours{1})
    throw invalid_argument("options::target_chunk_time must be between 1 us and 1 hour");
  if (!o.trace_file.empty() && !std::ofstream(o.trace_file, std::ios::out | std::ios::app))
    throw invalid_argument("options::trace_file: cannot write " + o.trace_file);
  validate(o.batching);
}

/// Every check of a job's options.
void validate(const job_options& o) {
  if (o.weight == 0) throw invalid_argument("job_options::weight must be at least 1");
  if (o.deadline.count() < 0) throw invalid_argument("job_options::deadline must not be negative");
  if (o.on_error.backoff.count() < 0 || o.on_error.backoff > std::chrono::hours{1})
    throw invalid_argument("error_policy::retry: the backoff must be between 0 and 1 hour");
}
namespace {

thread_local bool internal_thread = false;

constexpr auto remote_reply_timeout =
    std::chrono::milliseconds{120000};  // a remote producer's init

bool any_remote(const std::vector<device>& devices) {
  return std::any_of(devices.begin(), devices.end(), [](auto& d) { return !d.is_local(); });
}

}  // namespace

bool on_internal_thread() noexcept {
  return internal_thread;
}

void mark_internal_thread() noexcept {
  internal_thread = true;
}

void clear_internal_thread() noexcept {
  internal_thread = false;
}

caf::actor_system& local_system() {
  static caf::actor_system* sys = [] {
    auto* cfg = make_system_config(false).release();  // lives as long as the system: forever
    return new caf::actor_system(*cfg);
  }();
  return *sys;
}

runtime::runtime(std::vector<device> devices, config cfg, options opts, std::string job,
                 producer_maker make, caf::actor_system* app)
    : devices_(std::move(devices)),
      cfg_(std::move(cfg)),
      opts_(std::move(opts)),
      spawn_([make, wire = opts_.serialize](caf::actor_system& sys, const device& d,
                                            const config& c, std::size_t i) {
        return spawn_producer_actor(sys, make, d, c, i, wire);
      }),
      stats_(std::make_shared<stats_box>()) {
  check_and_count();
  for (auto& d : devices_)
    if (auto why = why_unavailable(d); !why.empty()) throw device_unavailable(why);
  bool network = any_remote(devices_);
  if (network && job.empty())
    throw invalid_argument(
        "remote devices need a registered job: add TROUPE_REGISTER_JOB(your_job) at namespace "
        "scope, in this program and in the nodes' programs");
  tls settings;
  for (auto& d : devices_)
    if (!d.is_local()) settings = tls_for(d.node());
  job_ = job;
  tls_ = settings;
  network_ = network;
  if (app) {
    if (network && !app->has_middleman())
      throw invalid_argument(
          "a runner over nodes' devices on an application's actor system needs CAF's "
          "middleman: call troupe::add_to(cfg) before constructing the actor_system");
    sys_ = app;
  } else {
    sys_ = network ? &network_system(settings) : &local_system();
  }
  auto spawned = spawn_all(job, settings);  // ends what it started when it throws
  init_all(spawned, devices_, 0, false);    // ends them all when one fails
  scheduler_ = spawn_scheduler(*sys_, spawned, devices_, opts_, stats_, spawn_, cfg_, true, nullptr,
                               node_actors(devices_));
  if (anchor_) caf::anon_send(anchor_, scheduler_);  // where a draining node's notice goes
  publish();
  open_ = true;
  gate_->rt = this;
  enlist();
  log(log_level::debug, "runner started with " + std::to_string(devices_.size()) + " producer(s)");
}

void runtime::check_and_count() {
  if (devices_.empty())
    throw invalid_argument(
        "the device list is empty: pass troupe::cpus(n), troupe::gpus() "
        "or device specs such as {\"cpu\", \"cuda:0\"}");
  validate(opts_);
  for (std::size_t i = 0; i < devices_.size(); ++i) {
    producer_stats ps;
    ps.index = i;
    ps.where = devices_[i];
    stats_->value.producers.push_back(ps);
  }
}

std::vector<caf::actor> runtime::spawn_all(const std::string&, const tls&) {
  std::vector<caf::actor> spawned;
  caf::scoped_actor self{*sys_};
  for (std::size_t i = 0; i < devices_.size(); ++i) {
    auto& d = devices_[i];
    try {
      spawned.push_back(d.is_local() ? spawn_(*sys_, d, cfg_, i) : spawn_remote(d, i));
    } catch (...) {
      for (auto& p : spawned) self->send_exit(p, caf::exit_reason::user_shutdown);
      if (anchor_) self->send_exit(anchor_, caf::exit_reason::user_shutdown);
      anchor_ = nullptr;
      throw;
    }
  }
  return spawned;
}

caf::actor runtime::spawn_remote(const device& d, std::size_t i) {
  caf::actor anchor;
  {
    // close() ends the anchor under this lock; add_devices may run beside it.
    std::lock_guard<std::mutex> guard{mtx_};
    if (scheduler_ && !open_) throw runner_closed("add_devices() after close()");
    if (!anchor_)  // remote producers live as long as this actor: the nodes monitor it
      anchor_ = sys_->spawn(anchor_actor, 0);
    anchor = anchor_;
  }
  // Watched: the node's death ends the wait at once (ask_node.hpp); a failed node is connected
  // anew next time (a node restarted, say).
  return spawn_on_node(*sys_, nodes_[d.node()], d.node(), tls_,
                       spawn_producer{job_, find_job(job_).signature, d.local().str(), cfg_, i},
                       anchor, deadlines_);
}

std::vector<caf::actor> runtime::node_actors(const std::vector<device>& ds) {
  std::vector<caf::actor> out;
  for (auto& d : ds) {
    auto i = d.is_local() ? nodes_.end() : nodes_.find(d.node());
    out.push_back(i != nodes_.end() ? i->second : caf::actor{});
  }
  return out;
}

void runtime::init_all(const std::vector<caf::actor>& spawned, const std::vector<device>& ds,
                       std::size_t first, bool keep_anchor) {
  std::vector<caf::actor> started;
  std::string failure, failed_node;
  errc failure_code = errc::none;
  {
    // Every producer constructs its job object concurrently, on its own thread. A remote one's
    // answer is watched: its node's death ends the wait at once (CAF would wait the whole
    // remote_reply_timeout).
    std::vector<std::future<caf::expected<init_done>>> replies;
    for (std::size_t i = 0; i < spawned.size(); ++i)
      replies.push_back(ask_watched<init_done>(
          *sys_, spawned[i], ds[i].is_local() ? std::chrono::milliseconds{0} : remote_reply_timeout,
          init_atom::value));
    for (std::size_t i = 0; i < replies.size(); ++i) {
      auto got = replies[i].get();
      if (got) {
        started.push_back(spawned[i]);
      } else if (failure_code == errc::none) {
        failure_code = error_code(got.error());
        failure = error_text(got.error());
        if (!ds[i].is_local()) failed_node = ds[i].node();
        if (failure_code != errc::device_unavailable)
          failure = "producer " + ds[i].str() + " (producer " + std::to_string(first + i) +
                    "): " + failure;
      }
    }
    caf::scoped_actor self{*sys_};
    if (failure_code != errc::none) {
      for (auto& p : spawned)
        if (std::find(started.begin(), started.end(), p) == started.end())
          self->send_exit(p, caf::exit_reason::user_shutdown);
    }
  }
  if (failure_code == errc::none) return;
  abandon(started, keep_anchor);
  if (failure_code == errc::device_unavailable) throw device_unavailable(failure);
  if (failure_code == errc::node_error) {
    if (!failed_node.empty()) throw node_start_failed(failure, failed_node);
    throw node_error(failure);
  }
  throw init_error(failure + "; the producers that did start were ended");
}

std::vector<bool> runtime::present() const {
  // Gone: removed (remove_devices, a node's drain), quarantined, or lost (on a node: for good,
  // also when its cluster fenced it: the scheduler marks the loss).
  std::vector<bool> out(slots_.size(), true);
  std::lock_guard<std::mutex> guard{stats_->mtx};
  auto& ps = stats_->value.producers;
  for (std::size_t i = 0; i < slots_.size() && i < ps.size(); ++i)
    out[i] = !ps[i].removed && !ps[i].quarantined && (ps[i].alive || slots_[i].is_local());
  return out;
}

void runtime::publish() {
  if (slots_.empty()) slots_ = devices_;  // at construction
  published_presence_.store(stats_->presence.load(std::memory_order_acquire),
                            std::memory_order_release);
  std::vector<device> now;
  auto here = present();
  for (std::size_t i = 0; i < slots_.size(); ++i)
    if (here[i]) now.push_back(slots_[i]);
  if (!published_.empty() && published_.back() == now) return;  // unchanged: the same snapshot
  published_.push_back(std::move(now));
  current_.store(&published_.back());
  // Not every list handed out is kept for the runner's life: one per membership change would
  // grow without bound for a long-lived runner over a fleet whose nodes come and go
  // (bench/churn_soak; a 1,000-node list is ~100 kB). The oldest go once kept_snapshots newer
  // ones exist: a devices() reference stays valid for that many changes (a deque: the others
  // do not move).
  while (published_.size() > kept_snapshots) published_.pop_front();
}

void runtime::abandon(const std::vector<caf::actor>& started, bool keep_anchor) noexcept {
  // A runner that failed to start (or producers added that failed to start): end what did
  // start, all at once, within close_timeout in all. Watched: end() sent to a producer whose node
  // died is never answered (CAF 0.17), and a node killed while add() started producers on it
  // held add() for the whole close_timeout (seen in CI: 5 s for a kill 5 ms into the join).
  try {
    auto limit = finite_wait(opts_.close_timeout).value_or(std::chrono::milliseconds{0});
    std::vector<std::future<caf::expected<consume_ack>>> ends;
    for (auto& p : started)
      ends.push_back(ask_watched<consume_ack>(*sys_, p, limit, end_atom::value));
    for (auto& e : ends)
      if (auto got = e.get(); !got)
        log(log_level::warn, "ending a started producer failed: " + error_text(got.error()));
    caf::scoped_actor self{*sys_};
    for (auto& p : started) self->send_exit(p, caf::exit_reason::user_shutdown);
    if (anchor_ && !keep_anchor) self->send_exit(anchor_, caf::exit_reason::user_shutdown);
  } catch (const std::exception& e) {
    log(log_level::error, std::string{"ending the started producers failed: "} + e.what());
  }
  if (!keep_anchor) anchor_ = nullptr;
}

runtime::~runtime() {
  unfollow();  // first: the cluster's notifier may be inside this runtime (waited for)
  delist();
  close();
}

void runtime::close() noexcept {
  {
    std::lock_guard<std::mutex> guard{gate_->mtx};  // waits for a submit() under way
    gate_->rt = nullptr;
  }
  {
    std::lock_guard<std::mutex> guard{mtx_};
    for (auto& a : owned_) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    owned_.clear();
  }
  if (sim_) {
    close_simulated();
    return;
  }
  std::shared_future<void> closed;
  try {
    std::unique_lock<std::mutex> lock{mtx_};
    if (open_) {
      open_ = false;
      // The scheduler ends every job (runner_closed), then every producer, then itself.
      auto promise = std::make_shared<std::promise<void>>();
      closed_ = promise->get_future().share();
      // On troupe's own threads (on_progress, a job's code) nobody waits for it: the scheduler
      // then keeps close_timeout itself.
      caf::anon_send(scheduler_, close_atom::value, std::move(promise), on_internal_thread());
    }
    closed = closed_;
    // On troupe's own threads waiting would deadlock: the scheduler and the jobs finish
    // closing by themselves.
    if (on_internal_thread() || !closed.valid()) return;
    lock.unlock();
    // Bounded: producers still busy after close_timeout are left behind. (Kept here rather
    // than by a timer in the scheduler, which would keep its thread alive that long.) The
    // margin covers a scheduler that is itself blocked in on_progress.
    auto limit = finite_wait(opts_.close_timeout);  // milliseconds::max(): forever
    if (!limit) closed.wait();
    if (limit && closed.wait_for(*limit) != std::future_status::ready) {
      caf::anon_send(scheduler_, close_timeout_atom::value);
      if (closed.wait_for(std::chrono::seconds{5}) != std::future_status::ready)
        log(log_level::warn, "the scheduler did not confirm close() in time; left behind");
    }
    lock.lock();
    if (anchor_) caf::anon_send_exit(anchor_, caf::exit_reason::user_shutdown);
    anchor_ = nullptr;
  } catch (const std::exception& e) {
    log(log_level::error, std::string{"closing the runner failed: "} + e.what());
  }
}

bool runtime::is_open() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return open_;
}

troupe::stats runtime::stats() const {
  std::lock_guard<std::mutex> guard{stats_->mtx};
  return stats_->value;
}

std::shared_ptr<job_core> runtime::submit(std::shared_ptr<input_source> source,
                                          const consumer_spawner& spawn, bool ordered,
                                          job_options o, bool fold) {
  validate(o);
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (!open_) throw runner_closed("submit() or run() after close(): create a new runner");
  }
  // options::max_queued_items: counted now, taken away by the scheduler as items are pulled.
  std::uint64_t counted = source->total().value_or(0);
  if (counted) {
    auto& q = stats_->queued;
    auto now = q.load();
    do {
      if (opts_.max_queued_items && now + counted > opts_.max_queued_items)
        throw overloaded("submit(): " + std::to_string(now) + " items are waiting already; " +
                         std::to_string(counted) + " more would pass options::max_queued_items (" +
                         std::to_string(opts_.max_queued_items) + "); the job was not started");
    } while (!q.compare_exchange_weak(now, now + counted));
  }
  struct uncount {  // until the scheduler has the job
    std::atomic<std::uint64_t>& q;
    std::uint64_t n;
    bool armed = true;
    ~uncount() {
      if (armed) q -= n;
    }
  } undo{stats_->queued, counted};
  auto core = std::make_shared<job_core>(0, scheduler_);
  {  // what progress() says until the scheduler's first report: nothing done, of this many
    progress p;
    p.total = source->total();
    core->set_progress(p);
  }
  core->gate()->succeeded = [weak = std::weak_ptr<job_core>(core)] {
    if (auto c = weak.lock()) c->finish(nullptr);
  };
  caf::actor consumer;
  try {
    consumer = spawn(*sys_, core->gate());
  } catch (const std::exception& e) {  // out of memory, or of whatever the system ran out of
    throw runner_closed(std::string{"submit(): the job's consumer could not be created ("} +
                        e.what() + "); the job was not started");
  }
  core->set_consumer(consumer);
  core->set_lease(source->lease());
  std::lock_guard<std::mutex> guard{mtx_};
  if (!open_) {
    caf::anon_send_exit(consumer, caf::exit_reason::user_shutdown);
    throw runner_closed("the runner was closed while the job was submitted");
  }
  core->set_id(next_job_++);
  if (sim_) sim_->adopt(core);
  watch(core);
  auto spec = std::make_shared<job_spec>();
  spec->core = core;
  spec->source = std::move(source);
  spec->consumer = std::move(consumer);
  spec->ordered = ordered;
  spec->opts = std::move(o);
  spec->fold = fold;
  // Sent under the lock: close() sends close_atom under it too, so the scheduler always sees
  // this job before it closes (and ends it with runner_closed).
  caf::anon_send(scheduler_, std::move(spec));
  undo.armed = false;
  return core;
}

}  // namespace troupe::detail
