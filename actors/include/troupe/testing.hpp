// Message-level testing of a job (docs/api.md, "Message-level testing"): spawn one producer (or
// one consumer) of a job in a test actor system, send it typed messages, and check the replies,
// without a runner.
//
//   troupe::testing::producer_probe<my_job> p{"cpu", cfg};
//   EXPECT_EQ(p.work({1, 2, 3}), (std::vector<std::int64_t>{1, 4, 9}));
//   auto r = p.send(troupe::work_chunk{7, 100, troupe::batch::of<std::int64_t>({-1})});
//   EXPECT_EQ(r.code, troupe::errc::work_error);
#pragma once

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>
#include <memory>
#include <optional>
#include <vector>

#include "troupe/detail/job_actors.hpp"
#include "troupe/detail/network.hpp"
#include "troupe/detail/runtime.hpp"
#include "troupe/error.hpp"
#include "troupe/protocol.hpp"
#include "troupe/simulation.hpp"

namespace troupe::testing {

/// `x` serialized the way a node receives it (a batch of one item, through CAF's binary
/// serializer) and read back into a fresh object. A type whose inspect() forgets a field comes
/// back without it. Throws troupe::protocol_error when it fails to serialize or deserialize, or
/// reads back fewer bytes than it wrote.
template <class T>
T round_trip(const T& x) {
  static_assert(detail::wire_serializable<T>,
                "troupe::testing::round_trip: T needs an inspect() overload, or to be a struct "
                "of plain data (include "
                "<troupe/torch.hpp> for tensors)");
  ensure_batch_type<T>();
  auto copy = round_trip_batch(batch::of(std::vector<T>{x}), "round_trip");
  auto* items = copy.template as<T>();
  if (items == nullptr || items->items.size() != 1)
    throw protocol_error("round_trip: the copy holds another type or count of items");
  return std::move(items->items.front());
}

/// How a probe talks to its producer.
struct probe_options {
  std::size_t index = 0;   ///< the producer's index (its constructor's third argument)
  bool serialize = false;  ///< every chunk through the wire format, as options::serialize
};

/// An actor system for tests, with the settings troupe's runners use.
class test_system {
 public:
  test_system() : cfg_(detail::make_system_config(false)), sys_(*cfg_) {}
  caf::actor_system& get() { return sys_; }

 private:
  std::unique_ptr<caf::actor_system_config> cfg_;
  caf::actor_system sys_;
};

template <class Job>
class producer_probe {
 public:
  using traits = detail::job_traits<Job>;
  using input_type = typename traits::input_type;
  using output_type = typename traits::output_type;

  /// Spawns the producer and sends it init_atom. Throws what a runner would throw
  /// (init_error, device_unavailable).
  explicit producer_probe(device d = "cpu", config cfg = {}, probe_options o = {})
      : sys_(std::make_unique<test_system>()), self_(sys_->get()) {
    if (o.serialize) detail::register_wire_types<Job>();
    actor_ = detail::spawn_producer_actor(sys_->get(), &detail::make_producer_ops<Job>, d,
                                          std::move(cfg), o.index, o.serialize);
    caf::error failed;
    self_->request(actor_, caf::infinite, init_atom::value)
        .receive([](const init_done&) {}, [&](caf::error& e) { failed = std::move(e); });
    if (failed) {
      self_->send_exit(actor_, caf::exit_reason::user_shutdown);
      throw_error(error_code(failed), error_text(failed));
    }
  }
  ~producer_probe() {
    if (actor_) self_->send_exit(actor_, caf::exit_reason::user_shutdown);
  }

  /// Sends one raw work message and returns the producer's reply.
  chunk_result send(const work_chunk& w) {
    chunk_result out;
    self_->request(actor_, caf::infinite, w)
        .receive([&](chunk_result& r) { out = std::move(r); },
                 [&](caf::error& e) { throw_error(error_code(e), error_text(e)); });
    return out;
  }

  /// Sends `items` as one work chunk starting at index `first`; returns the outputs or throws
  /// work_error with the failing item's index.
  std::vector<output_type> work(std::vector<input_type> items, std::uint64_t first = 0) {
    auto r = send(work_chunk{1, first, batch::of(std::move(items))});
    if (r.code == errc::work_error) throw work_error(r.what, r.failed_index, where_);
    if (!r.ok()) throw_error(r.code, r.what);
    return r.outputs.template as<output_type>()->items;
  }

  /// Sends end_atom: producer::end() runs. Throws what it threw, as troupe::error.
  void end() {
    self_->request(actor_, caf::infinite, end_atom::value)
        .receive([](const consume_ack&) {},
                 [&](caf::error& e) { throw_error(error_code(e), error_text(e)); });
  }

  caf::actor handle() const { return actor_; }
  caf::scoped_actor& self() { return self_; }

 private:
  std::unique_ptr<test_system> sys_;
  caf::scoped_actor self_;
  caf::actor actor_;
  std::string where_ = "test producer";
};

template <class Job>
class consumer_probe {
 public:
  using traits = detail::job_traits<Job>;
  using output_type = typename traits::output_type;
  using result_type = typename traits::result_type;

  /// Spawns the consumer and constructs its job object (throws consumer_error).
  explicit consumer_probe(config cfg = {})
      : sys_(std::make_unique<test_system>()),
        self_(sys_->get()),
        slot_(std::make_shared<std::optional<result_type>>()) {
    actor_ = detail::spawn_consumer_actor(sys_->get(), detail::make_consumer_maker<Job>(slot_),
                                          std::move(cfg));
    ask(init_atom::value);
  }
  ~consumer_probe() { self_->send_exit(actor_, caf::exit_reason::user_shutdown); }

  /// Feeds outputs to consumer::work (throws consumer_error).
  void work(std::vector<output_type> items) { ask(consume_chunk{1, batch::of(std::move(items))}); }
  /// Calls consumer::end() and returns its value (throws consumer_error).
  result_type end() {
    ask(end_of_input{1});
    return std::move(**slot_);
  }

 private:
  template <class Message>
  void ask(Message msg) {
    self_->request(actor_, caf::infinite, std::move(msg))
        .receive([](const consume_ack&) {},
                 [&](caf::error& e) { throw_error(error_code(e), error_text(e)); });
  }

  std::unique_ptr<test_system> sys_;
  caf::scoped_actor self_;
  caf::actor actor_;
  detail::result_slot<result_type> slot_;
};

}  // namespace troupe::testing
