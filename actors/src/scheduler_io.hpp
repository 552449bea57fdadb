// The commands the scheduler's core gives (scheduler.hpp): the actor shell runs them with CAF
// (scheduler_actor.cpp), a test records them (tests/scheduler_core_test.cpp).
#pragma once

#include <chrono>
#include <cstdint>

#include "planted_bug.hpp"
#include "producer_model.hpp"
#include "troupe/device.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

/// The commands the scheduler gives. Each answer comes back as the event named beside it.
class scheduler_io {
 public:
  /// consumer_read: what consumers took while nothing else happened (scheduler::read_consumers).
  enum class timer { deadline, wakeup, stall_check, close_timeout, drain_end, consumer_read };
  virtual ~scheduler_io() = default;
  /// Now: steady_clock in a runner, virtual time in a simulation.
  virtual clock_type::time_point now() = 0;
  /// To producer `p` (generation `gen`): on_result(p, gen, job, id, answer), or
  /// producer_failed(p, gen, why, unreachable) when it cannot answer.
  virtual void send_chunk(std::size_t p, std::uint64_t gen, std::uint64_t id, work_chunk msg) = 0;
  /// producer::end() on `p`: producer_ended() either way.
  virtual void end_producer(std::size_t p) = 0;
  /// Ends `p`'s actor without waiting (a producer given up on, or left at close).
  virtual void stop_producer(std::size_t p) = 0;
  /// A node producer given up on (its node lost, or stuck past work_timeout): no message to it
  /// (a stuck one's answers still come, and are dropped), only what is kept of it let go.
  virtual void forget_producer(std::size_t /*p*/) {}
  /// A fresh producer on `p`'s device, generation `gen`: replaced(p, gen) once constructed, or
  /// replace_failed(p, gen, why). Throws std::exception when none can be started.
  virtual void replace_producer(std::size_t p, std::uint64_t gen) = 0;
  /// Outputs to the job's consumer (`n` of them): the consumer counts them in the job's gate
  /// (job_gate::chunk_done) and answers consumer_acked(job) when the gate asks, and for the last;
  /// or consumer_failed(job, why).
  virtual void consume(consume_chunk msg, std::size_t n) = 0;
  /// The job's input is complete (consumer::end()): input_ended(job) or consumer_failed(job,
  /// why).
  virtual void end_input(std::uint64_t job) = 0;
  /// timer_fired(t, id) after `after`.
  virtual void set_timer(std::chrono::nanoseconds after, timer t, std::uint64_t id) = 0;
  /// The job has ended: its consumer is no longer needed here.
  virtual void forget_job(std::uint64_t job) = 0;
  /// The scheduler has closed: nothing more will come from it.
  virtual void quit() = 0;
  /// The mistake planted in this scheduler (planted_bug): none but in tests.
  [[nodiscard]] virtual planted_bug planted() const { return planted_bug::none; }
  /// Whether producer `p`'s chunks can be cut: one on `d` in this process shares the
  /// work_chunk's cut; one on a node is trimmed through its node (trim_remote).
  [[nodiscard]] virtual bool cuts_reach(std::size_t p, const device& d) const {
    (void)p;
    return d.is_local();
  }
  /// Chunk `id` of `job` at producer `p` (a node's, generation `gen`), sent with `cut_id`, of
  /// `items` items: its node takes back the items not claimed (all, or the later half; `ask`:
  /// it runs late, its producer gives back the claimed items it has not started);
  /// trimmed(p, gen, job, id, kept) with the items its producer keeps, or -1 (nothing taken).
  /// May never be answered (the node died: its loss comes as producer_down).
  virtual void trim_remote(std::size_t p, std::uint64_t gen, std::uint64_t job, std::uint64_t id,
                           std::uint64_t cut_id, std::uint64_t items, bool all, bool ask) {
    (void)p, (void)gen, (void)job, (void)id, (void)cut_id, (void)items, (void)all, (void)ask;
  }
};

}  // namespace troupe::detail
