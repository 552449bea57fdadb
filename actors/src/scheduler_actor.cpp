// The scheduler actor: the single owner of run state. It pulls input as producers have room
// (each producer keeps about one round trip of work queued, at least two chunks), sizes chunks
// per producer, keeps the table of pending chunks (which producers hold each one), re-sends
// the chunks of a lost or stuck producer, replaces stuck local producers, orders outputs
// through a bounded reorder window (placed after retries, so a retried chunk never reorders
// output), sends a chunk that holds up the end of a run or an ordered run's window to an idle
// producer as well (first answer wins), drives the consumer, and ends the producers at close().
#include <algorithm>
#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <set>
#include <unordered_map>

#include "troupe/bulk.hpp"
#include "troupe/detail/runtime.hpp"
#include "troupe/error.hpp"
#include "troupe/log.hpp"
#include "troupe/messages.hpp"

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<troupe::detail::run_spec>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<std::promise<void>>)

namespace troupe::detail {
namespace {

using clock_type = std::chrono::steady_clock;
constexpr std::size_t min_depth = 2;   ///< chunks queued at a producer, at least
constexpr std::size_t max_depth = 32;  ///< and at most (distant producers),
/// holding at most this many times options::max_chunk_bytes
constexpr std::size_t max_queued_chunk_bytes = 8;
constexpr int max_restarts_in_row = 3;  ///< per slot and run, without an answer in between

/// The scheduler's own timers.
using stall_check_atom = caf::atom_constant<caf::atom("tr_stall")>;

/// A chunk sent to a producer and not answered yet.
struct sent_chunk {
  std::uint64_t run = 0;
  std::uint64_t id = 0;
  std::size_t items = 0;
  clock_type::time_point sent;
  std::size_t behind = 0;  ///< chunks the producer still had when this one was sent
  std::size_t bytes = 0;   ///< the chunk's size in memory (max_chunk_bytes when unknown)
};

struct producer_slot {
  caf::actor handle;
  device where;
  bool local = true;
  std::uint64_t gen = 0;  ///< answers of a handle given up on carry an older generation
  bool alive = true;      ///< takes work
  bool restarting = false;
  int restarts_in_row = 0;
  std::deque<sent_chunk> outstanding;  ///< in the order sent (a producer works FIFO)
  std::size_t items = 0;               ///< items outstanding
  clock_type::time_point last_done{};  ///< when its last answer arrived
  double ns_per_item = 0;              ///< measured inside producer::work; 0 = not yet
  std::size_t chunk_items = 1;
  std::size_t depth = min_depth;  ///< chunks kept queued at it
  std::size_t calm = 0;           ///< answers in a row without the producer starving
  double chunk_bytes = 0;         ///< the size of the chunks it gets, on average
};

/// A chunk of the current run, from its dispatch until its outputs are delivered.
struct chunk {
  std::uint64_t first = 0;  ///< index of its first item in the run's input
  batch items;
  std::vector<std::size_t> holders;  ///< producers it has been sent to and that still hold it
};

class scheduler {
 public:
  scheduler(caf::event_based_actor* self, std::vector<caf::actor> producers,
            std::vector<device> devices, options opts, std::shared_ptr<stats_box> stats,
            producer_spawner spawn, config cfg)
      : self_(self),
        opts_(std::move(opts)),
        stats_(std::move(stats)),
        spawn_(std::move(spawn)),
        cfg_(std::move(cfg)) {
    for (std::size_t i = 0; i < producers.size(); ++i) {
      // CAF 0.17 never fails a request to a dead node: monitors (and heartbeats) tell us.
      self_->monitor(producers[i]);
      producer_slot s;
      s.handle = std::move(producers[i]);
      s.where = devices[i];
      s.local = devices[i].is_local();
      if (opts_.chunk_size) s.chunk_items = opts_.chunk_size;
      producers_.push_back(std::move(s));
    }
    self_->set_down_handler([this](caf::down_msg& dm) {
      for (std::size_t p = 0; p < producers_.size(); ++p)
        if (producers_[p].handle.address() == dm.source && !producers_[p].restarting)
          give_up(p, dm.reason);
    });
    if (opts_.work_timeout.count() > 0) schedule_stall_check();
  }

  void start(std::shared_ptr<run_spec> spec) {
    if (closing_) {
      spec->done.set_exception(
          std::make_exception_ptr(runner_closed("the runner was closed before this run started")));
      return;
    }
    if (run_) {  // runtime serializes runs; this would be a bug
      spec->done.set_exception(
          std::make_exception_ptr(protocol_error("a run started while another was active")));
      return;
    }
    run_ = std::move(spec);
    next_item_ = next_chunk_ = deliver_chunk_ = consumed_ = 0;
    exhausted_ = ending_ = false;
    failure_ = nullptr;
    backlog_ = 0;
    started_ = last_progress_ = clock_type::now();
    for (auto& s : producers_) s.restarts_in_row = 0;  // at most max_restarts_in_row per run
    check_survivors();
    pump();
  }

  /// options::work_timeout: gives up on producers that have been on one chunk too long.
  void check_stalls() {
    if (closing_) return;
    auto now = clock_type::now();
    for (std::size_t p = 0; p < producers_.size(); ++p) {
      auto& s = producers_[p];
      if (!s.alive || s.outstanding.empty()) continue;
      // A producer works FIFO: its oldest chunk started when it was sent or when the chunk
      // ahead of it was answered, whichever came later. Time spent queued does not count.
      auto began = std::max(s.outstanding.front().sent, s.last_done);
      if (now - began >= opts_.work_timeout)
        give_up(p, make_error(errc::node_error, "busy with one chunk for more than " +
                                                    std::to_string(opts_.work_timeout.count()) +
                                                    " ms (options::work_timeout)"));
    }
    schedule_stall_check();
  }

  /// close(): ends the run (runner_closed), then every producer (producer::end()), within
  /// options::close_timeout in all (close_timeout_atom); producers still busy then are left
  /// behind. `timed`: this actor keeps that time itself (when nobody waits for `done`); else the
  /// waiting closer sends close_timeout_atom, so that no timer keeps this actor's thread alive
  /// after it has quit.
  void close(std::shared_ptr<std::promise<void>> done, bool timed) {
    if (closing_) {
      done->set_value();
      return;
    }
    closing_ = true;
    close_promise_ = std::move(done);
    if (run_)
      finish(std::make_exception_ptr(runner_closed("the runner was closed during this run")));
    for (auto& s : producers_) {
      if (!s.alive) {  // stuck, lost or still starting: not waited on
        if (s.handle) self_->send_exit(s.handle, caf::exit_reason::user_shutdown);
        continue;
      }
      ++pending_ends_;
      auto where = s.where.str();
      self_->request(s.handle, caf::infinite, end_atom::value)
          .then([this](const consume_ack&) { ended_one(); },
                [this, where](const caf::error& err) {
                  log(log_level::warn,
                      "ending the producer on " + where + " failed: " + error_text(err));
                  ended_one();
                });
    }
    if (pending_ends_ == 0)
      finish_close();
    else if (timed)
      self_->delayed_send(self_, opts_.close_timeout, close_timeout_atom::value);
  }

  void close_timed_out() {
    if (!close_promise_) return;
    log(log_level::warn, std::to_string(pending_ends_) +
                             " producer(s) did not finish within options::close_timeout; left "
                             "behind (their threads end when work() returns)");
    finish_close();
  }

 private:
  // -- dispatch --------------------------------------------------------------------------

  void schedule_stall_check() {
    auto period = std::clamp<std::chrono::milliseconds>(
        opts_.work_timeout / 4, std::chrono::milliseconds{10}, std::chrono::milliseconds{1000});
    self_->delayed_send(self_, period, stall_check_atom::value);
  }

  /// The reorder window in chunks. Automatic: room for every producer's queue twice over,
  /// counted in the chunks of the fastest one: while a slow producer works through its queue,
  /// the fast ones must not run out of window (capped, for the memory bound).
  std::size_t window() const {
    if (opts_.reorder_window) return opts_.reorder_window;
    double slowest = 0;
    for (auto& s : producers_)
      if (s.alive) slowest = std::max(slowest, s.ns_per_item * static_cast<double>(chunk_limit(s)));
    std::size_t chunks = 0;
    for (auto& s : producers_) {
      if (!s.alive) continue;
      auto own = std::max(1.0, s.ns_per_item * static_cast<double>(chunk_limit(s)));
      auto ratio = s.ns_per_item > 0 ? std::min(64.0, std::ceil(slowest / own)) : 1.0;
      chunks += s.depth * static_cast<std::size_t>(ratio);
    }
    auto floor = 4 * producers_.size();
    return std::clamp(2 * chunks, floor, std::max<std::size_t>(floor, 256));
  }

  bool consumer_has_room() const { return backlog_ < opts_.consumer_backlog; }

  bool window_open() const {
    return consumer_has_room() && (!run_->ordered || next_chunk_ - deliver_chunk_ < window());
  }

  std::size_t chunk_limit(const producer_slot& s) const {
    auto n = opts_.chunk_size ? opts_.chunk_size : s.chunk_items;
    if (opts_.max_in_flight) n = std::min(n, opts_.max_in_flight);
    return std::max<std::size_t>(n, 1);
  }

  /// The live producer with room and the least work queued, or -1.
  int pick_producer() const {
    int best = -1;
    for (std::size_t i = 0; i < producers_.size(); ++i) {
      auto& s = producers_[i];
      if (!s.alive || s.outstanding.size() >= s.depth) continue;
      if (opts_.max_in_flight && !s.outstanding.empty() &&
          s.items + chunk_limit(s) > opts_.max_in_flight)
        continue;
      if (best < 0) {
        best = static_cast<int>(i);
        continue;
      }
      auto& b = producers_[best];
      auto load = [](const producer_slot& x) {
        return static_cast<double>(x.outstanding.size()) / static_cast<double>(x.depth);
      };
      if (load(s) < load(b) || (load(s) == load(b) && s.items < b.items))
        best = static_cast<int>(i);
    }
    return best;
  }

  void pump() {
    while (run_ && !failure_ && !closing_) {
      int p = pick_producer();
      if (p < 0) break;
      auto& s = producers_[static_cast<std::size_t>(p)];
      if (!retry_.empty()) {
        auto id = *retry_.begin();
        retry_.erase(retry_.begin());
        send(static_cast<std::size_t>(p), id);
      } else if (!exhausted_ && window_open()) {
        chunk c;
        try {
          c.items =
              run_->source->pull(chunk_limit(s), opts_.max_chunk_bytes, opts_.target_chunk_time);
        } catch (...) {
          exhausted_ = true;
          fail(std::current_exception());
          break;
        }
        exhausted_ = run_->source->exhausted();
        if (c.items.empty()) break;
        auto id = next_chunk_++;
        c.first = next_item_;
        next_item_ += c.items.size();
        chunks_.emplace(id, std::move(c));
        send(static_cast<std::size_t>(p), id);
      } else if (opts_.speculative && s.outstanding.empty() && consumer_has_room()) {
        auto id = pick_copy(static_cast<std::size_t>(p));
        if (!id) break;
        send(static_cast<std::size_t>(p), *id);
      } else {
        break;
      }
    }
    maybe_finish();
  }

  /// For an idle producer with nothing new to take: the oldest chunk held by exactly one other
  /// producer (an ordered run's head of line, or the end of a run waiting on a slow producer).
  std::optional<std::uint64_t> pick_copy(std::size_t p) const {
    std::optional<std::uint64_t> best;
    for (auto& [id, c] : chunks_)
      if (c.holders.size() == 1 && c.holders[0] != p && (!best || id < *best)) best = id;
    return best;
  }

  void send(std::size_t p, std::uint64_t id) {
    auto& s = producers_[p];
    auto& c = chunks_.at(id);
    c.holders.push_back(p);
    sent_chunk rec;
    rec.run = run_->id;
    rec.id = id;
    rec.items = c.items.size();
    rec.sent = clock_type::now();
    rec.behind = s.outstanding.size();
    rec.bytes = c.items.get() ? c.items.get()->flat_bytes().value_or(opts_.max_chunk_bytes) : 0;
    s.outstanding.push_back(rec);
    s.items += rec.items;
    auto gen = s.gen;
    auto run = run_->id;
    // A large chunk for a remote producer travels as fragments, then a small reference.
    work_chunk msg{run, c.first, bulk::split_for(self_, s.handle, c.items)};
    self_->request(s.handle, caf::infinite, std::move(msg))
        .then([this, p, gen, id, run](chunk_result& r) { on_result(p, gen, id, run, r); },
              [this, p, gen](caf::error& err) {
                if (producers_[p].gen == gen && !producers_[p].restarting) give_up(p, err);
              });
  }

  // -- results -----------------------------------------------------------------------------

  void on_result(std::size_t p, std::uint64_t gen, std::uint64_t id, std::uint64_t run,
                 chunk_result& r) {
    // Joined first, even for an answer dropped below, so that its fragments are released.
    try {
      r.outputs = bulk::resolve(r.outputs);
    } catch (const std::exception& e) {
      r.outputs = {};
      if (r.ok()) {
        r.code = errc::protocol_error;
        r.what = e.what();
      }
    }
    auto& s = producers_[p];
    // An answer from a handle given up on (the chunk went elsewhere): dropped, so that every
    // output is delivered exactly once.
    if (s.gen != gen) return;
    auto now = clock_type::now();
    auto rec = std::find_if(s.outstanding.begin(), s.outstanding.end(),
                            [&](const sent_chunk& x) { return x.run == run && x.id == id; });
    if (rec != s.outstanding.end()) {
      learn(s, *rec, r, now);
      s.items -= rec->items;
      s.outstanding.erase(rec);
    }
    s.last_done = now;
    s.restarts_in_row = 0;
    {
      std::lock_guard<std::mutex> guard{stats_->mtx};
      stats_->value.producers[p].busy += std::chrono::nanoseconds{r.busy_ns};
    }
    if (!run_ || run_->id != run || closing_) return;  // an answer for a run that ended
    auto i = chunks_.find(id);
    if (i == chunks_.end()) {  // a copy elsewhere answered first
      pump();
      return;
    }
    auto n = i->second.items.size();
    chunks_.erase(i);
    if (!r.ok()) {
      if (r.code == errc::work_error)
        fail(std::make_exception_ptr(
            work_error("producer::work threw on item " + std::to_string(r.failed_index) + " on " +
                           s.where.str() + " (producer " + std::to_string(p) + "): " + r.what,
                       r.failed_index, s.where.str())));
      else
        fail(std::make_exception_ptr(protocol_error(r.what)));
      pump();
      return;
    }
    {
      std::lock_guard<std::mutex> guard{stats_->mtx};
      stats_->value.producers[p].items += n;
    }
    deliver(id, std::move(r.outputs));
    pump();
  }

  /// Per-item time (chunk size) and round trip (how many chunks to keep queued) of `s`.
  void learn(producer_slot& s, const sent_chunk& rec, const chunk_result& r,
             clock_type::time_point now) {
    auto busy = static_cast<double>(r.busy_ns);
    if (rec.items > 0 && r.ok()) {
      auto per_item = std::max(1.0, busy / static_cast<double>(rec.items));
      s.ns_per_item = s.ns_per_item == 0 ? per_item : 0.5 * s.ns_per_item + 0.5 * per_item;
      if (!opts_.chunk_size) {
        auto target = static_cast<double>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(opts_.target_chunk_time).count());
        auto want = static_cast<std::size_t>(std::max(1.0, target / s.ns_per_item));
        s.chunk_items =
            std::max<std::size_t>(1, std::min({want, opts_.max_chunk_items, s.chunk_items * 4}));
      }
    }
    // A local producer answers within microseconds: two chunks keep it busy. (Its answers can
    // still wait while this actor pulls input; queuing more for that would only cost memory.)
    if (s.local || !r.ok()) return;
    // A distant producer that sat idle although chunks were queued for it (this one was sent
    // behind others) starved while they travelled: keep that much more work queued. Shrink
    // slowly while it never starves, within [min_depth, max_depth] (the memory bound).
    s.chunk_bytes = s.chunk_bytes == 0 ? static_cast<double>(rec.bytes)
                                       : 0.8 * s.chunk_bytes + 0.2 * static_cast<double>(rec.bytes);
    // Never more than max_queued_bytes queued, beyond two chunks: big items (tensors) need no
    // deep queue to fill a link, and must not pile up in memory.
    auto by_bytes = std::max<std::size_t>(
        min_depth, static_cast<std::size_t>(
                       static_cast<double>(max_queued_chunk_bytes * opts_.max_chunk_bytes) /
                       std::max(1.0, s.chunk_bytes)));
    s.depth = std::min(s.depth, by_bytes);
    if (rec.behind == 0) return;
    auto chunk_ns = std::max(1.0, s.ns_per_item * static_cast<double>(chunk_limit(s)));
    auto idle = static_cast<double>(r.idle_ns);
    if (idle > 0.1 * chunk_ns) {
      s.depth = std::min(
          {max_depth, by_bytes, s.depth + static_cast<std::size_t>(std::ceil(idle / chunk_ns))});
      s.calm = 0;
    } else if (++s.calm >= 8 * s.depth && s.depth > min_depth) {
      s.depth -= 1;
      s.calm = 0;
    }
    (void)now;
  }

  /// A producer is lost (its actor or node died) or stuck (work_timeout): its chunks go to the
  /// others, its late answers are dropped, and a local one is replaced by a fresh one.
  void give_up(std::size_t p, const caf::error& err) {
    auto& s = producers_[p];
    if (!s.alive) return;
    s.alive = false;
    s.gen += 1;
    bool replace = s.local && !closing_ && s.restarts_in_row < max_restarts_in_row;
    log(log_level::warn, "producer " + std::to_string(p) + " on " + s.where.str() + " is " +
                             (err == caf::exit_reason::unreachable ? "unreachable" : "lost") +
                             " (" + error_text(err) + "); its work goes to the others" +
                             (replace ? ", and a fresh producer replaces it" : ""));
    {
      std::lock_guard<std::mutex> guard{stats_->mtx};
      stats_->value.producers[p].alive = false;
    }
    for (auto& rec : s.outstanding) {
      if (!run_ || rec.run != run_->id) continue;
      auto i = chunks_.find(rec.id);
      if (i == chunks_.end()) continue;
      auto& h = i->second.holders;
      h.erase(std::remove(h.begin(), h.end(), p), h.end());
      if (h.empty()) retry_.insert(rec.id);
    }
    s.outstanding.clear();
    s.items = 0;
    if (s.local) self_->send_exit(s.handle, caf::exit_reason::user_shutdown);
    if (replace) restart(p);
    check_survivors();
    pump();
  }

  /// Starts a fresh producer on the device of slot `p`; it takes work once constructed.
  void restart(std::size_t p) {
    auto& s = producers_[p];
    caf::actor fresh;
    try {
      fresh = spawn_(self_->system(), s.where, cfg_);
    } catch (const std::exception& e) {
      log(log_level::error, "cannot replace the producer on " + s.where.str() + ": " + e.what());
      return;
    }
    s.restarting = true;
    s.restarts_in_row += 1;
    s.handle = fresh;
    s.gen += 1;
    self_->monitor(fresh);
    auto gen = s.gen;
    self_->request(fresh, caf::infinite, init_atom::value)
        .then(
            [this, p, gen](const init_done&) {
              auto& s = producers_[p];
              if (s.gen != gen) return;
              s.restarting = false;
              if (closing_) {
                self_->send_exit(s.handle, caf::exit_reason::user_shutdown);
                return;
              }
              s.alive = true;
              s.outstanding.clear();
              s.items = 0;
              {
                std::lock_guard<std::mutex> guard{stats_->mtx};
                auto& ps = stats_->value.producers[p];
                ps.alive = true;
                ps.restarts += 1;
              }
              log(log_level::info, "producer " + std::to_string(p) + " on " + s.where.str() +
                                       " was replaced by a fresh one");
              pump();
            },
            [this, p, gen](const caf::error& err) {
              auto& s = producers_[p];
              if (s.gen != gen) return;
              s.restarting = false;
              log(log_level::error, "the replacement producer on " + s.where.str() +
                                        " failed to start: " + error_text(err));
              check_survivors();
              pump();
            });
  }

  /// Fails the run with node_error when no producer is left to take its work.
  void check_survivors() {
    if (!run_) return;
    if (std::any_of(producers_.begin(), producers_.end(),
                    [](auto& s) { return s.alive || s.restarting; }))
      return;
    std::string what = "every producer is lost (";
    bool all_local = true;
    for (std::size_t i = 0; i < producers_.size(); ++i) {
      what += (i ? ", " : "") + producers_[i].where.str();
      all_local = all_local && producers_[i].local;
    }
    what += "); " + std::to_string(retry_.size()) + " chunk(s) of work could not be done: ";
    what += all_local ? "their replacements were stuck too or failed to start (see the log); "
                        "create a new runner"
                      : "create a new runner, with reachable nodes";
    fail(std::make_exception_ptr(node_error(what)));
    retry_.clear();
  }

  // -- consumer ------------------------------------------------------------------------------

  void deliver(std::uint64_t id, batch outputs) {
    if (!run_->ordered) {
      send_to_consumer(std::move(outputs));
      return;
    }
    reorder_.emplace(id, std::move(outputs));
    for (auto i = reorder_.begin(); i != reorder_.end() && i->first == deliver_chunk_;
         i = reorder_.erase(i)) {
      send_to_consumer(std::move(i->second));
      ++deliver_chunk_;
    }
  }

  void send_to_consumer(batch outputs) {
    auto n = outputs.size();
    auto run = run_->id;
    backlog_ += 1;
    self_->request(run_->consumer, caf::infinite, consume_chunk{run, std::move(outputs)})
        .then(
            [this, run, n](const consume_ack&) {
              if (!run_ || run_->id != run) return;
              backlog_ -= 1;
              consumed_ += n;
              {
                std::lock_guard<std::mutex> guard{stats_->mtx};
                stats_->value.items += n;
              }
              report_progress(false);
              pump();
            },
            [this, run](caf::error& err) {
              if (!run_ || run_->id != run) return;
              backlog_ -= 1;
              fail(std::make_exception_ptr(consumer_error(error_text(err))));
              pump();
            });
  }

  void report_progress(bool final) {
    if (!opts_.on_progress) return;
    auto now = clock_type::now();
    if (!final && now - last_progress_ < std::chrono::milliseconds{100}) return;
    last_progress_ = now;
    progress p;
    p.done = consumed_;
    p.total = run_->source->total();
    p.elapsed_seconds = std::chrono::duration<double>(now - started_).count();
    p.items_per_second =
        p.elapsed_seconds > 0 ? static_cast<double>(consumed_) / p.elapsed_seconds : 0;
    try {
      opts_.on_progress(p);
    } catch (...) {
      log(log_level::warn, "on_progress threw; ignored");
    }
  }

  // -- the end of a run ----------------------------------------------------------------------

  void fail(std::exception_ptr e) {
    if (!failure_) failure_ = std::move(e);
  }

  void maybe_finish() {
    if (!run_) return;
    if (failure_) {
      // At once: chunks still at producers are answered into the void (their answers carry
      // this run's id), and the consumer is disposed of by run() before it returns.
      finish(failure_);
      return;
    }
    if (ending_ || !exhausted_ || !chunks_.empty() || !retry_.empty() || !reorder_.empty() ||
        backlog_ > 0)
      return;
    ending_ = true;
    auto run = run_->id;
    self_->request(run_->consumer, caf::infinite, end_of_input{run})
        .then(
            [this, run](const consume_ack&) {
              if (run_ && run_->id == run) finish(nullptr);
            },
            [this, run](caf::error& err) {
              if (run_ && run_->id == run)
                finish(std::make_exception_ptr(consumer_error(error_text(err))));
            });
  }

  void finish(std::exception_ptr e) {
    if (!e) report_progress(true);
    auto spec = std::move(run_);
    run_ = nullptr;
    spec->source.reset();  // the caller's range must not be touched once run() returns
    chunks_.clear();
    retry_.clear();
    reorder_.clear();
    {
      std::lock_guard<std::mutex> guard{stats_->mtx};
      stats_->value.runs += 1;
      if (e) stats_->value.failed_runs += 1;
    }
    if (e)
      spec->done.set_exception(std::move(e));
    else
      spec->done.set_value();
  }

  void ended_one() {
    if (pending_ends_ > 0 && --pending_ends_ == 0) finish_close();
  }

  void finish_close() {
    if (!close_promise_) return;
    for (auto& s : producers_)
      if (s.handle) self_->send_exit(s.handle, caf::exit_reason::user_shutdown);
    auto done = std::move(close_promise_);
    close_promise_ = nullptr;
    done->set_value();
    self_->quit();
  }

  caf::event_based_actor* self_;
  options opts_;
  std::shared_ptr<stats_box> stats_;
  producer_spawner spawn_;
  config cfg_;
  std::vector<producer_slot> producers_;
  bool closing_ = false;
  std::size_t pending_ends_ = 0;
  std::shared_ptr<std::promise<void>> close_promise_;

  std::shared_ptr<run_spec> run_;
  std::uint64_t next_item_ = 0;
  std::uint64_t next_chunk_ = 0;
  std::uint64_t deliver_chunk_ = 0;
  std::uint64_t consumed_ = 0;
  bool exhausted_ = false;
  bool ending_ = false;
  std::exception_ptr failure_;
  std::size_t backlog_ = 0;
  std::unordered_map<std::uint64_t, chunk> chunks_;  ///< dispatched, outputs not delivered
  std::set<std::uint64_t> retry_;                    ///< chunks no producer holds: oldest first
  std::map<std::uint64_t, batch> reorder_;
  clock_type::time_point started_;
  clock_type::time_point last_progress_;
};

}  // namespace

caf::actor spawn_scheduler(caf::actor_system& sys, std::vector<caf::actor> producers,
                           std::vector<device> devices, options opts,
                           std::shared_ptr<stats_box> stats, producer_spawner spawn, config cfg) {
  // The state travels as a spawn argument: a spawn without arguments makes CAF 0.17.6
  // dereference a null std::shared_ptr<std::tuple<>> (UBSan reports it).
  auto init = [producers = std::move(producers), devices = std::move(devices),
               opts = std::move(opts), spawn = std::move(spawn),
               cfg = std::move(cfg)](caf::event_based_actor* self,
                                     std::shared_ptr<stats_box> box) mutable -> caf::behavior {
    auto st =
        std::make_shared<scheduler>(self, std::move(producers), std::move(devices), std::move(opts),
                                    std::move(box), std::move(spawn), std::move(cfg));
    return {
        [st](std::shared_ptr<run_spec>& spec) {
          mark_internal_thread();
          st->start(std::move(spec));
        },
        [st](stall_check_atom) { st->check_stalls(); },
        [st](close_atom, std::shared_ptr<std::promise<void>>& done, bool timed) {
          mark_internal_thread();
          st->close(std::move(done), timed);
        },
        [st](close_timeout_atom) { st->close_timed_out(); },
        [](const bulk::fragment&) {},  // joined while it was deserialized
    };
  };
  return sys.spawn<caf::detached>(std::move(init), std::move(stats));
}

}  // namespace troupe::detail
