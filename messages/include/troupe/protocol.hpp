// troupe's protocol, in one place: every atom and message its actors exchange, and the node
// protocol's version. Every message has an inspect() overload, so that it can cross a network
// through CAF's serializers; the ones that cross are registered with CAF in one list
// (make_system_config, nodes/src/network.cpp: work_chunk, chunk_result, bulk::fragment,
// init_done, consume_ack, node_hello, spawn_producer).
//
// A job (the job's id is `run` in these messages):
//   runner ──init_atom──▶ producer ──init_done──▶ runner              (producer's constructor)
//   scheduler ──work_chunk──▶ producer ──chunk_result──▶ scheduler (plain messages, not a
//                                      request: the answer finds its slot by its chunk_tag)
//   scheduler ──consume_chunk──▶ consumer ··consume_ack··▶ scheduler  (plain messages; the
//                                      consumer counts each chunk in the job's gate and answers
//                                      only while the scheduler waits for it: job_gate::
//                                      chunk_done; its constructor runs with its first message)
//   scheduler ──consume_chunk (last)──▶ consumer (work, then end()) ──consume_ack──▶ scheduler
//   scheduler ──end_of_input──▶ consumer ──consume_ack──▶ scheduler (a job without outputs)
//   runner ──end_atom──▶ producer (producer::end()) ──consume_ack──▶ runner
//   handle ──cancel_atom, id──▶ scheduler (answered once the job's items are withdrawn)
//   stream reader ──room_atom──▶ stream consumer (the buffer has room again)
//   runner ──close_atom, promise, timed──▶ scheduler; ──close_timeout_atom──▶ scheduler
//   scheduler ──timer_atom, kind, id──▶ itself (timers: deadline, wakeup, stall check, close)
// Large payloads (≥ 1 MiB) to another node: bulk::fragment messages, then the message with a
// reference in place of the batch (troupe/internal/bulk.hpp).
//
// Nodes (node_protocol_version below):
//   coordinator ──hello_atom──▶ node ──node_hello──▶ coordinator
//   node::drain ──drain_atom──▶ node ──leaving_atom, producers──▶ owner ──▶ scheduler (drains
//   them: their chunks finish, end_atom); the node answers once they are gone (or at the deadline)
//   coordinator ──spawn_producer, owner──▶ node ──actor (a producer or a replica)──▶ coordinator
//   cluster watcher ──watch_atom──▶ node; node::drain ──leaving_atom, incarnation──▶ watcher
//   scheduler ──trim_atom, producer, cut_id, items, all, ask──▶ node ──kept (int64)──▶ scheduler
//   (a late chunk's items not claimed go back; the chunk's answer carries `kept` too)
//
// Training (torch/src/train.cpp): a replica speaks the producer's protocol, one command per
// work_chunk (a train_msg item: init, backward, apply, get/set params, get/set state; init is
// answered with an init_reply, the others with a train_msg), takes a
// ring_order from the coordinator to all-reduce its gradient with its neighbours, and passes
// ring_chunk items (torch/src/train_msg.hpp) to its right neighbour.
#pragma once

#include <caf/actor.hpp>
#include <caf/atom.hpp>
#include <caf/error.hpp>
#include <caf/make_message.hpp>
#include <caf/meta/type_name.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "troupe/batch.hpp"
#include "troupe/config.hpp"
#include "troupe/detail/chunk_cut.hpp"
#include "troupe/detail/work_outcome.hpp"
#include "troupe/error.hpp"

namespace troupe {

namespace detail {
class job_gate;
}  // namespace detail

using init_atom = caf::atom_constant<caf::atom("tr_init")>;
using end_atom = caf::atom_constant<caf::atom("tr_end")>;
/// Ends a job (with its id): answered once its items are withdrawn.
using cancel_atom = caf::atom_constant<caf::atom("tr_cancel")>;
/// From a stream's reader: the stream's buffer has room again.
using room_atom = caf::atom_constant<caf::atom("tr_room")>;
/// Asks the scheduler to close (with a std::promise<void> it fulfils once it has ended the run,
/// the producers and itself, and whether it keeps options::close_timeout itself).
using close_atom = caf::atom_constant<caf::atom("tr_close")>;
/// options::close_timeout has passed: producers still busy are left behind.
using close_timeout_atom = caf::atom_constant<caf::atom("tr_clto")>;
/// The scheduler's own timers, to itself: timer_atom, kind (scheduler_io::timer: a job's
/// deadline with its id, a wakeup for a retry's backoff or a late chunk, a work_timeout check,
/// close_timeout), id.
using timer_atom = caf::atom_constant<caf::atom("tr_timer")>;
/// Training: a local replica frees everything it holds (the replica, its tensors, its device
/// binding), answers with the same atom and quits.
using release_atom = caf::atom_constant<caf::atom("tr_release")>;

/// A contiguous run of items: `items[i]` is item number `first + i` of run `run`.
/// Where a chunk's answer goes in the scheduler that sent it: set on the chunk, copied to its
/// answer by every producer. Chunks go out as plain messages, not requests: a request costs its
/// sender an entry in CAF's table of awaited responses, a handler on the heap and a search of
/// the table per answer, three cache misses each way with thousands of chunks in flight
/// (BENCHMARKS.md, "the scheduler alone").
struct chunk_tag {
  std::uint64_t slot = 0;  ///< the producer's slot
  std::uint64_t gen = 0;   ///< the slot's generation when it was sent
  std::uint64_t id = 0;    ///< the piece's id in its job's table
};

struct work_chunk {
  std::uint64_t run = 0;  ///< the job's id
  std::uint64_t first = 0;
  batch items;
  /// Go on after an item throws (the job has an error policy other than fail()): the answer
  /// then holds the outputs of the items that worked and lists the ones that threw.
  bool keep_going = false;
  /// Local only (never written to the wire): the job's consumer has merge() and the job fails
  /// at its first error, so a producer in this process folds the chunk's outputs into a
  /// consumer of its own, looking at this gate as the job's consumer does; null otherwise.
  std::shared_ptr<detail::job_gate> fold{};
  /// Local only (never written to the wire), options::batching: this chunk is part
  /// `group_pos` of `group_size` consecutive chunks (of any jobs) that the producer works in one
  /// call; each is answered on its own. 0: alone.
  std::uint32_t group_size = 0;
  std::uint32_t group_pos = 0;
  /// Local only (never written to the wire), options::split_late_chunks: where the chunk ends,
  /// shared with the scheduler. The producer claims items here before it starts them; the
  /// scheduler takes back those not claimed for an idle producer. Null: every item is the
  /// producer's.
  std::shared_ptr<detail::chunk_cut> cut{};
  /// To a producer in another process, options::split_late_chunks: the chunk's number for
  /// trim_atom (growing in the order its coordinator sends that producer chunks); 0: not cut.
  std::uint64_t cut_id = 0;
  chunk_tag tag{};
};

/// A producer's answer to a work_chunk: all outputs, or the first failure.
struct chunk_result {
  std::uint64_t run = 0;
  std::uint64_t first = 0;
  batch outputs;
  /// Time spent inside producer::work; a CPU producer's, less what its thread waited for a CPU
  /// meanwhile (Linux's run delay): what the call cost, not what other threads cost it.
  std::int64_t busy_ns = 0;
  /// Time the producer sat idle between its previous chunk and this one: a producer that
  /// starves while chunks are on their way needs more of them queued (a distant node).
  std::int64_t idle_ns = 0;
  errc code = errc::none;          ///< none, or why the chunk failed
  std::uint64_t failed_index = 0;  ///< the failing item's index in the run
  std::string what;                ///< the failure's message
  /// keep_going: the items that threw, in index order; `outputs` holds the others' outputs.
  std::vector<item_error> failures;
  /// Batch producers: work(span) calls made again on halves of a batch that threw.
  std::uint64_t extra_calls = 0;
  /// A chunk with a cut_id trimmed on its node: the items it answers, [0, kept) (-1: all). Its
  /// coordinator may see this answer before the trim's own answer.
  std::int64_t kept = -1;
  chunk_tag tag{};  ///< its chunk's

  [[nodiscard]] bool ok() const noexcept { return code == errc::none; }
};

/// Outputs for the consumer (in input order for ordered runs). `last`: the job's final outputs;
/// the consumer runs consumer::end() right after them (no end_of_input follows).
struct consume_chunk {
  std::uint64_t run = 0;
  batch items;
  bool last = false;
};

/// Tells the consumer that the run's input is complete: it calls consumer::end().
struct end_of_input {
  std::uint64_t run = 0;
};

/// The consumer's (or a producer's end()) acknowledgement.
struct consume_ack {
  std::uint64_t run = 0;
};

/// The producer's answer to init_atom: its constructor finished.
struct init_done {
  std::string device;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, chunk_tag& x) {
  return f(caf::meta::type_name("troupe.chunk_tag"), x.slot, x.gen, x.id);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, work_chunk& x) {
  return f(caf::meta::type_name("troupe.work_chunk"), x.run, x.first, x.items, x.keep_going,
           x.cut_id, x.tag);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, item_error& x) {
  return f(caf::meta::type_name("troupe.item_error"), x.index, x.what);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, chunk_result& x) {
  return f(caf::meta::type_name("troupe.chunk_result"), x.run, x.first, x.outputs, x.busy_ns,
           x.idle_ns, x.code, x.failed_index, x.what, x.failures, x.extra_calls, x.kept, x.tag);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, consume_chunk& x) {
  return f(caf::meta::type_name("troupe.consume_chunk"), x.run, x.items, x.last);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, end_of_input& x) {
  return f(caf::meta::type_name("troupe.end_of_input"), x.run);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, consume_ack& x) {
  return f(caf::meta::type_name("troupe.consume_ack"), x.run);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, init_done& x) {
  return f(caf::meta::type_name("troupe.init_done"), x.device);
}

/// A caf::error in troupe's category, carrying one line of text.
caf::error make_error(errc code, std::string what);

/// The errc of a troupe error; errc::node_error for CAF's own errors (a lost peer, a dead actor).
errc error_code(const caf::error& err);

/// The text of a troupe error, or CAF's description of one of its own.
std::string error_text(const caf::error& err);

}  // namespace troupe

namespace troupe {

// -- node control (docs/api.md, several machines)
// ------------------------------------------------------------------

/// The version of troupe's node protocol; peers with another version are refused.
// 2: idle_ns; 3: keep_going, failures; 4: index; 5: chunk_result::extra_calls, leaving_atom;
// 6: node_hello::incarnation, leaving; 7: work_chunk::cut_id, chunk_result::kept, trim_atom;
// 8: a training replica answers init with an init_reply (its fields left train_msg);
// 9: work_chunk::tag, chunk_result::tag (chunks go out as plain messages)
// 10: train_msg::used (parameters no shard of a step used get no gradient)
constexpr std::uint32_t node_protocol_version = 10;

using hello_atom = caf::atom_constant<caf::atom("tr_hello")>;
/// node::drain, to the node's actor (with the deadline in milliseconds): answered once every
/// producer it spawned has ended, or at the deadline.
using drain_atom = caf::atom_constant<caf::atom("tr_drain")>;
/// A draining node, to each coordinator's owner actor (with the producers it holds there):
/// take no new work to them, let their chunks finish, end them. The owner hands it to its
/// scheduler.
using leaving_atom = caf::atom_constant<caf::atom("tr_leave")>;
/// A cluster's watcher, to a node: tell me when you leave (the node answers leaving_atom with
/// its incarnation when node::drain begins, at once if it drains already).
using watch_atom = caf::atom_constant<caf::atom("tr_watch")>;
/// A cluster, to a runner's scheduler (in-process): the node (address) was given up on; its
/// producers are lost now and their late answers are dropped (fenced).
using fence_atom = caf::atom_constant<caf::atom("tr_fence")>;
/// A cluster, to a node that answers as the process (incarnation) it gave up on: a freeze or a
/// partition that outlasted lost_after, healed. The node starts over as a restart would: it ends
/// every producer it holds, for every coordinator, and takes a new incarnation, which the
/// cluster's next probe admits (rejoined). Ignored unless the incarnation is the node's own.
using given_up_atom = caf::atom_constant<caf::atom("tr_givenup")>;
/// A coordinator, to the node's actor (options::split_late_chunks): trim_atom, the producer's
/// actor id, the chunk's cut_id, its items, all, ask. Takes back the items of that chunk its
/// producer has not claimed (all of them, or the later half), and with `ask` (the chunk runs
/// late) asks the producer for the claimed ones it has not started; answered with the items the
/// producer keeps (an int64), or -1 when nothing was taken. Only for the requesting
/// coordinator's producers.
using trim_atom = caf::atom_constant<caf::atom("tr_trim")>;

/// A node's answer to hello_atom: its protocol version, the devices it offers and its
/// incarnation (random, new at every start of the node's process: a restart is a new member).
struct node_hello {
  std::uint32_t version = 0;
  std::vector<std::string> devices;
  std::uint64_t incarnation = 0;
  bool leaving = false;  ///< node::drain has begun: it takes no new producer
};

/// Asks a node to spawn one producer of a registered job on one of its devices.
/// The node answers with the producer's handle, or an error.
struct spawn_producer {
  std::string job;
  std::string signature;  ///< the coordinator's "INPUT -> OUTPUT" type names
  std::string device;
  config cfg;
  std::uint64_t index = 0;  ///< the producer's place in the coordinator's device list
};

/// Training: a replica all-reduces its sum of attempt `attempt` in ring `ring` with its
/// neighbours, and answers `reply` (a chunk_result) when the ring is over or failed.
struct ring_order {
  std::uint64_t reply = 0;
  std::uint64_t ring = 0;
  std::uint64_t attempt = 0;     ///< the coordinator's attempt at the step whose sums it reduces
  std::uint32_t pos = 0, n = 0;  ///< its place in the ring, the ring's size
  caf::actor right;              ///< the right neighbour
  /// Through CAF: the right neighbour's node, when this replica must connect to it ("" when
  /// both are in one process, or one is the coordinator's).
  std::string address;
  /// Over the data plane: the right neighbour's data port ("host:port"), and the ring's key in
  /// hex; "" for CAF's path.
  std::string data, key;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, ring_order& x) {
  return f(caf::meta::type_name("troupe.ring_order"), x.reply, x.ring, x.attempt, x.pos, x.n,
           x.right, x.address, x.data, x.key);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, node_hello& x) {
  return f(caf::meta::type_name("troupe.node_hello"), x.version, x.devices, x.incarnation,
           x.leaving);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, spawn_producer& x) {
  return f(caf::meta::type_name("troupe.spawn_producer"), x.job, x.signature, x.device, x.cfg,
           x.index);
}

}  // namespace troupe
