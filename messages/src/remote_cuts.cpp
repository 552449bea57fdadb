#include "troupe/internal/remote_cuts.hpp"

#include <map>
#include <mutex>
#include <unordered_map>

namespace troupe::detail::remote_cuts {

namespace {

constexpr std::size_t max_waiting = 1024;  ///< chunks known per producer, at most

struct producer_cuts {
  std::uint64_t last_started = 0;  ///< the newest cut id its producer has begun
  std::map<std::uint64_t, std::shared_ptr<chunk_cut>> cuts;
};

struct table {
  std::mutex mtx;
  std::unordered_map<std::uint64_t, producer_cuts> by_producer;
};

table& the_table() {
  static auto& t = *new table;  // never destroyed: actor threads may use it during exit()
  return t;
}

}  // namespace

std::shared_ptr<chunk_cut> start(std::uint64_t producer, std::uint64_t cut_id,
                                 std::uint64_t items) {
  auto& t = the_table();
  std::lock_guard<std::mutex> guard{t.mtx};
  auto& p = t.by_producer[producer];
  if (cut_id > p.last_started) p.last_started = cut_id;
  auto& c = p.cuts[cut_id];
  if (!c) c = std::make_shared<chunk_cut>(items);
  return c;
}

void finish(std::uint64_t producer, std::uint64_t cut_id) noexcept {
  auto& t = the_table();
  std::lock_guard<std::mutex> guard{t.mtx};
  auto i = t.by_producer.find(producer);
  if (i != t.by_producer.end()) i->second.cuts.erase(cut_id);
}

void forget(std::uint64_t producer) noexcept {
  auto& t = the_table();
  std::lock_guard<std::mutex> guard{t.mtx};
  t.by_producer.erase(producer);
}

std::int64_t trim(std::uint64_t producer, std::uint64_t cut_id, std::uint64_t items, bool all,
                  bool ask) {
  if (items == 0 || items > chunk_cut::max_items) return -1;
  auto& t = the_table();
  std::lock_guard<std::mutex> guard{t.mtx};
  auto& p = t.by_producer[producer];
  auto i = p.cuts.find(cut_id);
  if (i == p.cuts.end()) {
    if (cut_id <= p.last_started) return -1;  // begun and answered already
    // A coordinator keeps a few chunks queued at a producer: more is not a real one's trim
    // (a hostile peer's would grow this table without bound).
    if (p.cuts.size() >= max_waiting) return -1;
    // Not begun yet (it waits in the producer's mailbox): its cut starts here, and the
    // producer finds it trimmed when it begins.
    i = p.cuts.emplace(cut_id, std::make_shared<chunk_cut>(items)).first;
  }
  if (ask) i->second->ask();
  auto keep = i->second->trim(all);
  return keep ? static_cast<std::int64_t>(*keep) : -1;
}

std::size_t size() noexcept {
  auto& t = the_table();
  std::lock_guard<std::mutex> guard{t.mtx};
  std::size_t n = 0;
  for (auto& [id, p] : t.by_producer) n += p.cuts.size();
  return n;
}

}  // namespace troupe::detail::remote_cuts
