// The producer and consumer actors (compiled in the library, driving a job's producer_ops and
// consumer_ops). Each producer runs on a thread of its own (CAF detached actors), so a producer
// blocked inside work() never stalls another; consumers share the actor system's threads. No
// exception crosses an actor boundary: failures become chunk_result codes or troupe errors. Not
// included by <troupe/troupe.hpp>: only troupe's own sources and <troupe/testing.hpp> need CAF's
// actor headers.
#pragma once

#include <caf/actor.hpp>
#include <caf/fwd.hpp>
#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "troupe/config.hpp"
#include "troupe/detail/job_gate.hpp"
#include "troupe/detail/job_ops.hpp"
#include "troupe/device.hpp"
#include "troupe/protocol.hpp"

namespace troupe::detail {

class stream_buffer;

/// Spawns the producer actor of a job on device `d` (detached). It constructs the job's producer
/// object (`make`) when it receives init_atom, runs chunks, and runs producer::end() on end_atom.
/// `serialize`: every chunk's inputs and outputs go through the wire format (options::serialize).
caf::actor spawn_producer_actor(caf::actor_system& sys, producer_maker make, device d, config cfg,
                                std::size_t index, bool serialize = false);

/// Spawns the consumer actor of one job, on the actor system's shared threads (no thread of its
/// own); `make` runs on its first message. `gate`: shared with the job's handle (a fresh one
/// when null, for probes).
caf::actor spawn_consumer_actor(caf::actor_system& sys, consumer_maker make, config cfg,
                                std::shared_ptr<job_gate> gate = nullptr);

/// Spawns the consumer actor of a stream: it hands each chunk of outputs to the reader's
/// buffer, never waiting; while the buffer is full it holds back its acknowledgements, which
/// pauses the job's dispatch.
caf::actor spawn_stream_consumer(caf::actor_system& sys, std::shared_ptr<stream_buffer> buf,
                                 std::shared_ptr<job_gate> gate);

}  // namespace troupe::detail
