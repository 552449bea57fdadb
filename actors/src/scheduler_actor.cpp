// The scheduler actor: the single owner of run state. It pulls input through credits (at most
// two chunks in flight per producer), sizes chunks adaptively, keeps the in-flight table,
// re-dispatches the chunks of a lost producer, orders outputs through a bounded reorder window
// (placed after retries, so a retried chunk never reorders output) and drives the consumer.
#include <algorithm>
#include <caf/actor_system.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/stateful_actor.hpp>
#include <chrono>
#include <map>
#include <unordered_map>

#include "troupe/bulk.hpp"
#include "troupe/detail/runtime.hpp"
#include "troupe/error.hpp"
#include "troupe/log.hpp"
#include "troupe/messages.hpp"

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<troupe::detail::run_spec>)

namespace troupe::detail {
namespace {

using clock_type = std::chrono::steady_clock;
constexpr std::size_t chunks_per_producer = 2;

struct producer_slot {
  caf::actor handle;
  device where;
  std::size_t chunks = 0;  ///< chunks in flight
  std::size_t items = 0;   ///< items in flight
  bool alive = true;
};

struct chunk {
  std::uint64_t id = 0;     ///< position among the run's chunks (the reorder key)
  std::uint64_t first = 0;  ///< index of its first item in the run's input
  batch items;
  std::size_t producer = 0;
  clock_type::time_point sent;  ///< when it was last dispatched
};

/// The scheduler's own timer for options::work_timeout (carries the run id).
using stall_check_atom = caf::atom_constant<caf::atom("tr_stall")>;

class scheduler {
 public:
  scheduler(caf::event_based_actor* self, std::vector<caf::actor> producers,
            std::vector<device> devices, options opts, std::shared_ptr<stats_box> stats)
      : self_(self), opts_(std::move(opts)), stats_(std::move(stats)) {
    for (std::size_t i = 0; i < producers.size(); ++i) {
      // CAF 0.17 never fails a request to a dead node: monitors (and heartbeats) tell us.
      self_->monitor(producers[i]);
      producers_.push_back(producer_slot{std::move(producers[i]), devices[i]});
    }
    self_->set_down_handler([this](caf::down_msg& dm) {
      for (std::size_t p = 0; p < producers_.size(); ++p)
        if (producers_[p].handle.address() == dm.source) on_lost(p, run_ ? run_->id : 0, dm.reason);
    });
    window_ = opts_.reorder_window ? opts_.reorder_window : 4 * producers_.size();
  }

  void start(std::shared_ptr<run_spec> spec) {
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
    if (opts_.chunk_size) chunk_size_ = opts_.chunk_size;
    check_survivors();
    pump();
    if (run_ && opts_.work_timeout.count() > 0) schedule_stall_check();
  }

  /// options::work_timeout: gives up on producers whose oldest chunk is overdue.
  void check_stalls(std::uint64_t run) {
    if (!run_ || run_->id != run) return;  // the timer of a run that ended
    auto now = clock_type::now();
    std::vector<std::size_t> stuck;
    for (auto& [id, c] : in_flight_)
      if (now - c.sent >= opts_.work_timeout &&
          std::find(stuck.begin(), stuck.end(), c.producer) == stuck.end())
        stuck.push_back(c.producer);
    for (auto p : stuck)
      if (run_ && run_->id == run)
        on_lost(p, run,
                make_error(errc::node_error, "no answer to a chunk for " +
                                                 std::to_string(opts_.work_timeout.count()) +
                                                 " ms (options::work_timeout)"));
    if (run_ && run_->id == run) schedule_stall_check();
  }

 private:
  // -- dispatch --------------------------------------------------------------------------

  void schedule_stall_check() {
    auto period = std::clamp<std::chrono::milliseconds>(
        opts_.work_timeout / 4, std::chrono::milliseconds{10}, std::chrono::milliseconds{1000});
    self_->delayed_send(self_, period, stall_check_atom::value, run_->id);
  }

  bool window_open() const {
    if (backlog_ >= opts_.consumer_backlog) return false;
    return !run_->ordered || next_chunk_ - deliver_chunk_ < window_;
  }

  std::size_t chunk_limit() const {
    auto n = chunk_size_;
    if (opts_.max_in_flight) n = std::min(n, opts_.max_in_flight);
    return std::max<std::size_t>(n, 1);
  }

  /// The live producer with capacity and the fewest items in flight, or -1.
  int pick_producer() const {
    int best = -1;
    for (std::size_t i = 0; i < producers_.size(); ++i) {
      auto& p = producers_[i];
      if (!p.alive || p.chunks >= chunks_per_producer) continue;
      if (opts_.max_in_flight && p.chunks > 0 && p.items + chunk_limit() > opts_.max_in_flight)
        continue;
      if (best < 0 || p.items < producers_[best].items) best = static_cast<int>(i);
    }
    return best;
  }

  void pump() {
    while (run_ && !failure_) {
      int p = pick_producer();
      if (p < 0) break;
      chunk c;
      if (!retry_.empty()) {
        c = std::move(retry_.front());
        retry_.pop_front();
      } else if (!exhausted_ && window_open()) {
        try {
          c.items = run_->source->pull(chunk_limit(), opts_.max_chunk_bytes);
        } catch (...) {
          exhausted_ = true;
          fail(std::current_exception());
          break;
        }
        exhausted_ = run_->source->exhausted();
        if (c.items.empty()) break;
        c.id = next_chunk_++;
        c.first = next_item_;
        next_item_ += c.items.size();
      } else {
        break;
      }
      dispatch(static_cast<std::size_t>(p), std::move(c));
    }
    maybe_finish();
  }

  void dispatch(std::size_t p, chunk c) {
    auto& slot = producers_[p];
    c.producer = p;
    c.sent = clock_type::now();
    slot.chunks += 1;
    slot.items += c.items.size();
    auto id = c.id;
    auto run = run_->id;
    // A large chunk for a remote producer travels as fragments, then a small reference.
    work_chunk msg{run, c.first, bulk::split_for(self_, slot.handle, c.items)};
    in_flight_.emplace(id, std::move(c));
    self_->request(slot.handle, caf::infinite, std::move(msg))
        .then([this, id, run, p](chunk_result& r) { on_result(p, id, run, r); },
              [this, run, p](caf::error& err) { on_lost(p, run, err); });
  }

  // -- results -----------------------------------------------------------------------------

  void on_result(std::size_t from, std::uint64_t id, std::uint64_t run, chunk_result& r) {
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
    if (!run_ || run_->id != run) return;  // a late answer from a run that already ended
    auto i = in_flight_.find(id);
    // Given up on: its producer was declared lost, and the chunk may be running elsewhere now.
    // Dropping the late answer keeps every output exactly once.
    if (i == in_flight_.end() || i->second.producer != from || !producers_[from].alive) return;
    auto& slot = producers_[i->second.producer];
    auto n = i->second.items.size();
    slot.chunks -= 1;
    slot.items -= n;
    auto p = i->second.producer;
    in_flight_.erase(i);
    if (!r.ok()) {
      if (r.code == errc::work_error)
        fail(std::make_exception_ptr(
            work_error("producer::work threw on item " + std::to_string(r.failed_index) + " on " +
                           slot.where.str() + " (producer " + std::to_string(p) + "): " + r.what,
                       r.failed_index, slot.where.str())));
      else
        fail(std::make_exception_ptr(protocol_error(r.what)));
      pump();
      return;
    }
    {
      std::lock_guard<std::mutex> guard{stats_->mtx};
      auto& ps = stats_->value.producers[p];
      ps.items += n;
      ps.busy += std::chrono::nanoseconds{r.busy_ns};
    }
    adapt_chunk_size(n, r.busy_ns);
    if (!failure_) deliver(id, std::move(r.outputs));
    pump();
  }

  void on_lost(std::size_t p, std::uint64_t run, const caf::error& err) {
    auto& slot = producers_[p];
    if (slot.alive) {
      slot.alive = false;
      log(log_level::warn, "producer " + std::to_string(p) + " on " + slot.where.str() +
                               " is lost (" + error_text(err) + "); its work goes to the others");
      std::lock_guard<std::mutex> guard{stats_->mtx};
      stats_->value.producers[p].alive = false;
    }
    if (!run_ || run_->id != run) return;
    // Every chunk of the lost producer goes back to the front of the queue, oldest first.
    std::vector<std::uint64_t> lost;
    for (auto& [cid, c] : in_flight_)
      if (c.producer == p) lost.push_back(cid);
    std::sort(lost.begin(), lost.end());
    for (auto i = lost.rbegin(); i != lost.rend(); ++i) {
      retry_.push_front(std::move(in_flight_[*i]));
      in_flight_.erase(*i);
    }
    slot.chunks = slot.items = 0;
    check_survivors();
    pump();
  }

  /// Fails the run with node_error when no producer is left to take its work.
  void check_survivors() {
    if (std::any_of(producers_.begin(), producers_.end(), [](auto& s) { return s.alive; })) return;
    std::string what = "every producer is lost (";
    for (std::size_t i = 0; i < producers_.size(); ++i)
      what += (i ? ", " : "") + producers_[i].where.str();
    fail(std::make_exception_ptr(node_error(what + "); " + std::to_string(retry_.size()) +
                                            " chunk(s) of work could not be done: create a new "
                                            "runner, with reachable nodes")));
    retry_.clear();
  }

  void adapt_chunk_size(std::size_t n, std::int64_t busy_ns) {
    if (opts_.chunk_size || n == 0) return;
    auto per_item = std::max<double>(1.0, static_cast<double>(busy_ns) / static_cast<double>(n));
    auto target = static_cast<double>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(opts_.target_chunk_time).count());
    auto want = static_cast<std::size_t>(std::max(1.0, target / per_item));
    want = std::min({want, opts_.max_chunk_items, chunk_size_ * 4});
    chunk_size_ = std::max<std::size_t>(want, 1);
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
      // Wait for the producers' current chunks, so that the next run starts on quiet producers.
      if (in_flight_.empty()) finish(failure_);
      return;
    }
    if (ending_ || !exhausted_ || !in_flight_.empty() || !retry_.empty() || !reorder_.empty() ||
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
    report_progress(true);
    auto spec = std::move(run_);
    run_ = nullptr;
    spec->source.reset();  // the caller's range must not be touched once run() returns
    in_flight_.clear();
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

  caf::event_based_actor* self_;
  options opts_;
  std::shared_ptr<stats_box> stats_;
  std::vector<producer_slot> producers_;
  std::size_t window_ = 0;
  std::size_t chunk_size_ = 1;

  std::shared_ptr<run_spec> run_;
  std::uint64_t next_item_ = 0;
  std::uint64_t next_chunk_ = 0;
  std::uint64_t deliver_chunk_ = 0;
  std::uint64_t consumed_ = 0;
  bool exhausted_ = false;
  bool ending_ = false;
  std::exception_ptr failure_;
  std::size_t backlog_ = 0;
  std::unordered_map<std::uint64_t, chunk> in_flight_;
  std::deque<chunk> retry_;
  std::map<std::uint64_t, batch> reorder_;
  clock_type::time_point started_;
  clock_type::time_point last_progress_;
};

}  // namespace

caf::actor spawn_scheduler(caf::actor_system& sys, std::vector<caf::actor> producers,
                           std::vector<device> devices, options opts,
                           std::shared_ptr<stats_box> stats) {
  // The state travels as a spawn argument: a spawn without arguments makes CAF 0.17.6
  // dereference a null std::shared_ptr<std::tuple<>> (UBSan reports it).
  auto init = [producers = std::move(producers), devices = std::move(devices),
               opts = std::move(opts)](caf::event_based_actor* self,
                                       std::shared_ptr<stats_box> box) mutable -> caf::behavior {
    auto st = std::make_shared<scheduler>(self, std::move(producers), std::move(devices),
                                          std::move(opts), std::move(box));
    return {
        [st](std::shared_ptr<run_spec>& spec) { st->start(std::move(spec)); },
        [st](stall_check_atom, std::uint64_t run) { st->check_stalls(run); },
        [](const bulk::fragment&) {},  // joined while it was deserialized
    };
  };
  return sys.spawn<caf::detached>(std::move(init), std::move(stats));
}

}  // namespace troupe::detail
