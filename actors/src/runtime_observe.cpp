// What observers read of a runner (troupe/detail/introspect.hpp): the runners alive in this
// process and their snapshots (troupe::metrics_text, the status page).
#include <algorithm>
#include <mutex>
#include <vector>

#include "runtime_impl.hpp"

namespace troupe::detail {

namespace {

/// The runners alive in this process (never destroyed: runners may outlive static objects).
struct runner_list {
  std::mutex mtx;
  std::vector<const runtime*> live;
  std::uint64_t next_id = 1;
};
runner_list& runners() {
  static auto* list = new runner_list;
  return *list;
}

}  // namespace

void runtime::delist() {
  auto& l = runners();
  std::lock_guard<std::mutex> guard{l.mtx};
  l.live.erase(std::remove(l.live.begin(), l.live.end(), this), l.live.end());
}

void runtime::enlist() {
  auto& l = runners();
  std::lock_guard<std::mutex> guard{l.mtx};
  observed_id_ = l.next_id++;
  l.live.push_back(this);
}

void runtime::watch(const std::shared_ptr<job_core>& core) {
  if (watched_.size() >= prune_watched_at_) {
    auto gone = [](const std::weak_ptr<job_core>& w) {
      auto c = w.lock();
      return !c || c->ended();
    };
    watched_.erase(std::remove_if(watched_.begin(), watched_.end(), gone), watched_.end());
    prune_watched_at_ = std::max<std::size_t>(64, 2 * watched_.size());
  }
  watched_.push_back(core);
}

runner_snapshot runtime::snapshot() const {
  runner_snapshot s;
  s.id = observed_id_;
  s.simulated = sim_ != nullptr;
  s.devices = devices();
  s.stats = stats();
  s.queued_items = stats_->queued.load();
  {
    std::lock_guard<std::mutex> guard{stats_->mtx};
    s.chunk_seconds = stats_->chunk_seconds;
    s.job_seconds = stats_->job_seconds;
    s.last_item_unix_seconds = stats_->last_item_unix_seconds;
    s.retries = stats_->retries;
    s.skipped_items = stats_->skipped_items;
    s.node_bytes_sent = stats_->node_bytes_sent;
    s.node_bytes_received = stats_->node_bytes_received;
    s.node_chunks_unsized = stats_->node_chunks_unsized;
    s.chunks_sent = stats_->chunks_sent;
    s.chunks_first_sent = stats_->chunks_first_sent;
    s.queue_wait = stats_->queue_wait;
    s.batch_hold = stats_->batch_hold;
  }
  std::vector<std::shared_ptr<job_core>> jobs;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    s.open = open_;
    s.jobs_submitted = next_job_ - 1;
    for (auto& w : watched_) {
      if (jobs.size() == runner_snapshot::running_jobs_listed) break;
      if (auto c = w.lock(); c && !c->ended()) jobs.push_back(std::move(c));
    }
  }
  // Outside the runner's lock: a job's own lock is never taken under it.
  for (auto& c : jobs) s.running_jobs.push_back({c->id(), c->current_progress()});
  return s;
}

published_list<trainer_view>& trainers() {
  static auto* list = new published_list<trainer_view>;  // never destroyed
  return *list;
}

work_totals& process_work() noexcept {
  static auto* totals = new work_totals;  // never destroyed: producers may outlive statics
  return *totals;
}

std::vector<runner_snapshot> runner_snapshots() {
  auto& l = runners();
  std::lock_guard<std::mutex> guard{l.mtx};
  std::vector<runner_snapshot> out;
  for (auto* r : l.live) out.push_back(r->snapshot());
  return out;
}

}  // namespace troupe::detail
