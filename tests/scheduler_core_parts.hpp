// The scheduler's core driven by hand (scheduler_core*_test.cpp): a fake scheduler_io that
// records every command, and a fixture that submits jobs and answers chunks.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <caf/actor.hpp>
#include <cstdlib>
#include <deque>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <tuple>
#include <vector>

#include "fault_points.hpp"
#include "scheduler.hpp"
#include "test_util.hpp"
#include "troupe/internal/remote_cuts.hpp"

namespace {

using namespace std::chrono_literals;

using troupe::batch;
using troupe::chunk_result;
using troupe::consume_chunk;
using troupe::work_chunk;
using troupe::detail::clock_type;
using troupe::detail::scheduler;
using troupe::detail::scheduler_io;

/// Records the core's commands; the test answers them.
struct fake_io final : scheduler_io {
  struct sent {
    std::size_t p;
    std::uint64_t gen, id;
    work_chunk msg;
  };
  clock_type::time_point t{std::chrono::seconds{1}};
  std::deque<sent> chunks;
  std::deque<std::pair<consume_chunk, std::size_t>> to_consumer;
  std::vector<std::uint64_t> inputs_ended, forgotten;
  std::vector<std::size_t> stopped, ended, replaced;
  std::vector<std::pair<std::chrono::nanoseconds, timer>> timers;
  std::vector<std::tuple<clock_type::time_point, timer, std::uint64_t>> due;  ///< when each fires
  std::vector<std::pair<std::size_t, std::uint64_t>> fresh;  ///< replacements asked (p, gen)
  bool quitted = false;
  /// Producers on nodes have their chunks trimmed there (trim_remote), as the shell does.
  bool remote_cuts = false;
  struct trim {
    std::size_t p;
    std::uint64_t gen, job, id, cut_id, items;
    bool all, ask;
  };
  std::deque<trim> trims;

  /// A mistake planted in the scheduler (planted_bug).
  troupe::detail::planted_bug bug = troupe::detail::planted_bug::none;

  clock_type::time_point now() override { return t; }
  [[nodiscard]] troupe::detail::planted_bug planted() const override { return bug; }
  void send_chunk(std::size_t p, std::uint64_t gen, std::uint64_t id, work_chunk msg) override {
    chunks.push_back({p, gen, id, std::move(msg)});
  }
  void end_producer(std::size_t p) override { ended.push_back(p); }
  void stop_producer(std::size_t p) override { stopped.push_back(p); }
  void replace_producer(std::size_t p, std::uint64_t gen) override {
    replaced.push_back(p);
    fresh.emplace_back(p, gen);
  }
  void consume(consume_chunk msg, std::size_t n) override {
    to_consumer.emplace_back(std::move(msg), n);
  }
  void end_input(std::uint64_t job) override { inputs_ended.push_back(job); }
  void set_timer(std::chrono::nanoseconds after, timer k, std::uint64_t id) override {
    timers.emplace_back(after, k);
    due.emplace_back(t + after, k, id);
  }
  void forget_job(std::uint64_t job) override { forgotten.push_back(job); }
  void quit() override { quitted = true; }
  [[nodiscard]] bool cuts_reach(std::size_t, const troupe::device& d) const override {
    return d.is_local() || remote_cuts;
  }
  void trim_remote(std::size_t p, std::uint64_t gen, std::uint64_t job, std::uint64_t id,
                   std::uint64_t cut_id, std::uint64_t items, bool all, bool ask) override {
    trims.push_back({p, gen, job, id, cut_id, items, all, ask});
  }
};

/// The answer a producer that echoes its inputs gives to `s`.
inline chunk_result echo(const fake_io::sent& s, std::int64_t busy_ns = 1000) {
  chunk_result r;
  r.run = s.msg.run;
  r.first = s.msg.first;
  r.busy_ns = busy_ns;
  auto* in = s.msg.items.as<std::int64_t>();
  r.outputs = batch::of(in ? in->items : std::vector<std::int64_t>{});
  return r;
}

struct core_fixture {
  explicit core_fixture(std::vector<troupe::device> devices, troupe::options opts = {},
                        bool remote_cuts = false)
      : stats(std::make_shared<troupe::detail::stats_box>()) {
    io.remote_cuts = remote_cuts;
    stats->value.producers.resize(devices.size());
    core = std::make_unique<scheduler>(io, std::move(devices), std::move(opts), stats);
  }
  core_fixture(const core_fixture&) = delete;
  core_fixture& operator=(const core_fixture&) = delete;
  /// The core ran here, on the test's thread, and marked it as troupe's own (as its actor's
  /// thread is): a later test's waits on this thread would be refused as waiting for themselves.
  ~core_fixture() { troupe::detail::clear_internal_thread(); }

  std::shared_ptr<troupe::detail::job_core> submit(std::uint64_t id, std::int64_t n, bool ordered,
                                                   troupe::job_options o = {}) {
    auto job = std::make_shared<troupe::detail::job_core>(id, caf::actor{});
    core->start(job, troupe::detail::make_job_source<std::int64_t>(test_util::iota(n)), ordered,
                std::move(o));
    jobs[id] = job;
    return job;
  }

  /// The consumer takes `msg` (`n` outputs) as a real one does: counted in its job's gate, then
  /// acknowledged (more often than the scheduler asks: harmless).
  void take(const troupe::consume_chunk& msg, std::size_t n, troupe::detail::job_gate& gate) {
    gate.add_delivered(n);
    gate.chunk_done();
    core->consumer_acked(msg.run);
  }

  /// Answers chunk `s` as a producer that echoes its inputs.
  void answer(const fake_io::sent& s) {
    auto r = echo(s);
    core->on_result(s.p, s.gen, s.msg.run, s.id, r);
  }

  /// Answers the oldest chunk sent; returns the job it was of.
  std::uint64_t answer_oldest() {
    auto s = std::move(io.chunks.front());
    io.chunks.pop_front();
    answer(s);
    return s.msg.run;
  }

  /// Answers and acknowledges everything until nothing is left to send or consume; returns
  /// the outputs in the order they reached the consumer.
  std::vector<std::int64_t> run_to_end() {
    std::vector<std::int64_t> out;
    while (!io.chunks.empty() || !io.to_consumer.empty()) {
      auto more = consume_all();
      out.insert(out.end(), more.begin(), more.end());
      if (!io.chunks.empty()) answer_oldest();
    }
    return out;
  }

  /// Acknowledges every output sent to a consumer; returns the outputs in the order sent.
  std::vector<std::int64_t> consume_all() {
    std::vector<std::int64_t> out;
    while (!io.to_consumer.empty()) {
      auto [msg, n] = std::move(io.to_consumer.front());
      io.to_consumer.pop_front();
      if (auto* xs = msg.items.as<std::int64_t>())
        out.insert(out.end(), xs->items.begin(), xs->items.end());
      take(msg, n, *jobs.at(msg.run)->gate());
    }
    return out;
  }

  fake_io io;
  std::shared_ptr<troupe::detail::stats_box> stats;
  std::unique_ptr<scheduler> core;
  std::map<std::uint64_t, std::shared_ptr<troupe::detail::job_core>> jobs;  ///< by id (submit)
};

}  // namespace
