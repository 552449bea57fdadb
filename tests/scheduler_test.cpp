// The scheduler actor on CAF's deterministic test coordinator: fake producers that answer, fail,
// vanish or stall on cue, a fake consumer that records what it receives, and no thread of
// troupe's own. Every message is run by the test (sched.run()), so each test sees one exact
// interleaving; the assertions are on the consumer's sequence of outputs (order, each item
// once) after retries and re-dispatches, and on the job's report.
#include <gtest/gtest.h>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <caf/send.hpp>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <troupe/job_options.hpp>
#include <troupe/protocol.hpp>
#include <vector>

#include "runtime_impl.hpp"
#include "test_util.hpp"
#include "troupe/detail/job_actors.hpp"

namespace {

using troupe::batch;
using troupe::chunk_result;
using troupe::consume_ack;
using troupe::work_chunk;
using namespace std::chrono_literals;
/// Tells a stalled fake producer to send the answers it holds (late answers).
using release_atom = caf::atom_constant<caf::atom("release")>;

/// What one fake producer does with the chunks it receives.
struct fake_state {
  /// True for an item that throws in this producer (keep_going chunks list it as a failure).
  std::function<bool(std::int64_t)> fails;
  /// Chunks after which it stops answering: 0 = answers every chunk.
  std::size_t stall_after = 0;
  /// Answers every chunk as the producer of this slot (a tag not its own), outputs negated.
  std::optional<std::uint64_t> poses_as;
  /// Chunks after which it quits (vanishes) without answering the next: 0 = never.
  std::size_t vanish_after = 0;
  std::vector<std::uint64_t> firsts;        ///< the first item of every chunk it received
  std::vector<caf::response_promise> held;  ///< answers it owes (stalled)
  std::vector<chunk_result> owed;           ///< what it would have answered
};

chunk_result answer(const fake_state& st, const work_chunk& w) {
  chunk_result r;
  r.run = w.run;
  r.first = w.first;
  r.tag = w.tag;  // where the answer goes in the scheduler (the protocol: every producer does)
  r.busy_ns = 1000;
  std::vector<std::int64_t> out;
  auto* in = w.items.as<std::int64_t>();
  for (std::size_t i = 0; in != nullptr && i < in->items.size(); ++i) {
    auto index = w.first + i;
    if (st.fails && st.fails(static_cast<std::int64_t>(index))) {
      if (!w.keep_going) {
        r.code = troupe::errc::work_error;
        r.failed_index = index;
        r.what = "fake failure";
        return r;
      }
      r.failures.push_back(troupe::item_error{index, "fake failure"});
      continue;
    }
    out.push_back(st.poses_as ? -in->items[i] : in->items[i]);
  }
  r.outputs = batch::of(std::move(out));
  if (st.poses_as) r.tag.slot = *st.poses_as;
  return r;
}

caf::behavior fake_producer(caf::event_based_actor* self, std::shared_ptr<fake_state> st) {
  return {
      [](troupe::init_atom) { return troupe::init_done{"cpu"}; },
      [self, st](const work_chunk& w) -> caf::result<chunk_result> {
        st->firsts.push_back(w.first);
        auto n = st->firsts.size();
        if (st->vanish_after && n > st->vanish_after) {
          self->quit(caf::exit_reason::user_shutdown);
          return caf::make_error(caf::sec::request_receiver_down);
        }
        if (st->stall_after && n > st->stall_after) {
          st->held.push_back(self->make_response_promise());
          st->owed.push_back(answer(*st, w));
          return caf::delegated<chunk_result>{};
        }
        return answer(*st, w);
      },
      [st](release_atom) {
        for (std::size_t k = 0; k < st->held.size(); ++k) st->held[k].deliver(st->owed[k]);
        st->held.clear();
        st->owed.clear();
      },
      [](troupe::end_atom) { return consume_ack{}; },
  };
}

/// Records every output in the order received, counts each chunk in the job's gate as a consumer
/// does (job_gate::chunk_done), and acknowledges every one (more than the scheduler asks for:
/// harmless).
caf::behavior fake_consumer(caf::event_based_actor*,
                            std::shared_ptr<std::vector<std::int64_t>> seen,
                            std::shared_ptr<troupe::detail::job_gate> gate) {
  return {
      [](troupe::init_atom) { return consume_ack{}; },
      [seen, gate](troupe::consume_chunk& c) {
        if (auto* xs = c.items.as<std::int64_t>())
          seen->insert(seen->end(), xs->items.begin(), xs->items.end());
        gate->add_delivered(c.items.size());
        gate->chunk_done();
        return consume_ack{c.run};
      },
      [](const troupe::end_of_input& e) { return consume_ack{e.run}; },
      [](troupe::end_atom) { return consume_ack{}; },
  };
}

// Takes nothing: neither counts a chunk in its gate nor answers one; only counts what reaches it.
caf::behavior mute_consumer(caf::event_based_actor*, std::shared_ptr<int> received) {
  return {
      [](troupe::init_atom) { return consume_ack{}; },
      [received](troupe::consume_chunk&) {
        *received += 1;
        return caf::delegated<consume_ack>{};
      },
      [](troupe::end_atom) {},
  };
}

class SchedulerTest : public ::testing::Test {
 protected:
  SchedulerTest()
      : sys_(cfg_.set("scheduler.policy", caf::atom("testing"))),
        sched_(dynamic_cast<caf::scheduler::test_coordinator&>(sys_.scheduler())) {}
  ~SchedulerTest() override {
    if (scheduler_) caf::anon_send_exit(scheduler_, caf::exit_reason::user_shutdown);
    for (auto& p : producers_) caf::anon_send_exit(p, caf::exit_reason::user_shutdown);
    sched_.run();
    troupe::detail::clear_internal_thread();  // the scheduler ran on this thread
  }

  /// Starts a scheduler over one fake producer per state; replacements answer every chunk.
  /// `remote`: the indices of producers the scheduler takes for a node's (given up on, they are
  /// lost rather than ended and replaced, and may still answer late).
  void start(std::vector<std::shared_ptr<fake_state>> states, troupe::options opts,
             std::set<std::size_t> remote = {}) {
    states_ = std::move(states);
    std::vector<troupe::device> devices;
    for (std::size_t i = 0; i < states_.size(); ++i) {
      producers_.push_back(sys_.spawn(fake_producer, states_[i]));
      devices.emplace_back(remote.count(i) ? "127.0.0.1:1/cpu" : "cpu");
    }
    stats_ = std::make_shared<troupe::detail::stats_box>();
    stats_->value.producers.resize(states_.size());
    auto spawner = [this](caf::actor_system& sys, const troupe::device&, const troupe::config&,
                          std::size_t) {
      auto st = std::make_shared<fake_state>();
      replacements_.push_back(st);
      return sys.spawn(fake_producer, st);
    };
    scheduler_ = troupe::detail::spawn_scheduler(sys_, producers_, devices, std::move(opts), stats_,
                                                 spawner, {}, /*detached=*/false);
    sched_.run();
  }

  /// Submits a job of items 0..n-1 (ordered) and returns its core; outputs go to seen_.
  std::shared_ptr<troupe::detail::job_core> submit(std::int64_t n, troupe::job_options o,
                                                   bool mute = false) {
    auto spec = std::make_shared<troupe::detail::job_spec>();
    spec->core = std::make_shared<troupe::detail::job_core>(next_id_++, scheduler_);
    auto consumer = mute ? sys_.spawn(mute_consumer, muted_)
                         : sys_.spawn(fake_consumer, seen_, spec->core->gate());
    spec->core->set_consumer(consumer);
    spec->source = troupe::detail::make_job_source<std::int64_t>(test_util::iota(n));
    spec->consumer = consumer;
    spec->ordered = true;
    spec->opts = std::move(o);
    auto core = spec->core;
    caf::anon_send(scheduler_, std::move(spec));
    return core;
  }

  caf::actor_system_config cfg_;
  caf::actor_system sys_;
  caf::scheduler::test_coordinator& sched_;
  std::vector<std::shared_ptr<fake_state>> states_, replacements_;
  std::vector<caf::actor> producers_;
  caf::actor scheduler_;
  std::shared_ptr<troupe::detail::stats_box> stats_;
  std::shared_ptr<std::vector<std::int64_t>> seen_ = std::make_shared<std::vector<std::int64_t>>();
  std::uint64_t next_id_ = 1;
  std::shared_ptr<int> muted_ = std::make_shared<int>(0);  ///< chunks a mute consumer received
};

std::shared_ptr<fake_state> answering() {
  return std::make_shared<fake_state>();
}

troupe::options small_chunks(std::size_t n = 4) {
  troupe::options opts;
  opts.chunk_size = n;
  return opts;
}

}  // namespace

TEST_F(SchedulerTest, OrderedOutputsStayInOrderWhenItemsAreRetriedElsewhere) {
  // Producer 1 fails every item divisible by 7 (each time); the others never fail: every such
  // item is retried on another producer and still reaches the consumer in its place.
  auto flaky = answering();
  flaky->fails = [](std::int64_t i) { return i % 7 == 0; };
  start({answering(), flaky, answering()}, small_chunks());
  troupe::job_options o;
  o.on_error = troupe::error_policy::retry(2);
  auto job = submit(200, o);
  sched_.run();
  ASSERT_TRUE(job->done());
  EXPECT_EQ(job->error(), nullptr);
  EXPECT_EQ(*seen_, test_util::iota(200));  // in order, each item once
  auto r = job->report();
  EXPECT_GT(flaky->firsts.size(), 0u);
  EXPECT_GT(r.retries, 0u);
  EXPECT_TRUE(r.failures.empty());
}

TEST_F(SchedulerTest, ARetryAvoidsTheProducerThatFailed) {
  // Producer 0 fails item 5 at every attempt; producer 1 never does: with retry(1) the retry
  // must go to producer 1 (not back to 0), so the job succeeds.
  auto bad = answering();
  bad->fails = [](std::int64_t i) { return i == 5; };
  start({bad, answering()}, small_chunks());
  troupe::job_options o;
  o.on_error = troupe::error_policy::retry(1);
  auto job = submit(40, o);
  sched_.run();
  ASSERT_TRUE(job->done());
  EXPECT_EQ(job->error(), nullptr);
  EXPECT_EQ(*seen_, test_util::iota(40));
}

TEST_F(SchedulerTest, SkippedItemsLeaveGapsTheOrderPassesOver) {
  auto flaky = answering();
  flaky->fails = [](std::int64_t i) { return i % 10 == 3; };
  auto also = answering();
  also->fails = flaky->fails;
  start({flaky, also}, small_chunks(5));
  troupe::job_options o;
  o.on_error = troupe::error_policy::skip();
  auto job = submit(100, o);
  sched_.run();
  ASSERT_TRUE(job->done());
  EXPECT_EQ(job->error(), nullptr);
  std::vector<std::int64_t> expected;
  for (std::int64_t i = 0; i < 100; ++i)
    if (i % 10 != 3) expected.push_back(i);
  EXPECT_EQ(*seen_, expected);
  auto r = job->report();
  ASSERT_EQ(r.failures.size(), 10u);
  for (std::size_t k = 0; k < 10; ++k) EXPECT_EQ(r.failures[k].index, 10 * k + 3);
}

TEST_F(SchedulerTest, AProducerThatVanishesMidJobHasItsChunksRedispatchedInOrder) {
  auto vanishing = answering();
  vanishing->vanish_after = 2;  // answers two chunks, then quits holding the third
  start({answering(), vanishing, answering()}, small_chunks());
  auto job = submit(300, {});
  sched_.run();
  ASSERT_TRUE(job->done());
  EXPECT_EQ(job->error(), nullptr);
  EXPECT_EQ(*seen_, test_util::iota(300));
  EXPECT_GE(job->report().redispatched, 1u);
  EXPECT_TRUE(stats_->value.producers[1].alive);  // a lost local producer is replaced
  EXPECT_EQ(stats_->value.producers[1].restarts, 1u);
  ASSERT_EQ(replacements_.size(), 1u);
}

TEST_F(SchedulerTest, AnAnswerThatPosesAsAnotherProducersIsDroppedNotDelivered) {
  // Producer 1 answers every chunk with producer 0's slot in its tag and wrong outputs. A chunk
  // goes out as a plain message and its answer finds its slot by its tag: an answer from an
  // actor other than the slot's must not be delivered (it would be, by producer 0's slot, with
  // the piece's id), so producer 1 looks stalled, is given up on, and its chunks go elsewhere.
  auto liar = answering();
  liar->poses_as = 0;
  auto opts = small_chunks();
  opts.work_timeout = 20ms;
  opts.speculative = false;
  start({answering(), liar}, opts, /*remote=*/{1});
  auto job = submit(100, {});
  sched_.run();
  ASSERT_FALSE(job->done());  // the ordered window waits for producer 1's first chunk
  std::this_thread::sleep_for(40ms);
  while (!job->done() && sched_.trigger_timeout()) sched_.run();
  ASSERT_TRUE(job->done());
  EXPECT_EQ(job->error(), nullptr);
  EXPECT_EQ(*seen_, test_util::iota(100));  // no negated item
  EXPECT_GE(stats_->value.late_answers, 1u);
  EXPECT_FALSE(stats_->value.producers[1].alive);
}

TEST_F(SchedulerTest, AForgedAcknowledgementEndsNoJobItsConsumerHasNotTaken) {
  // A consumer acknowledges with a plain message (consume_ack), which anyone holding the
  // scheduler's address can send: a node's producer, say. The scheduler reads what the
  // consumer took from the job's gate, not from the message, so acknowledgements the consumer
  // never sent free no room and end nothing: this consumer takes no chunk, so it gets
  // consumer_backlog chunks and no more, and its job stays open.
  start({answering(), answering()}, small_chunks());
  auto job = submit(40, {}, /*mute=*/true);
  sched_.run();
  ASSERT_EQ(*muted_, 4);  // options::consumer_backlog
  for (int i = 0; i < 20; ++i) caf::anon_send(scheduler_, consume_ack{job->id()});
  sched_.run();
  EXPECT_EQ(*muted_, 4) << "a forged acknowledgement made room";
  EXPECT_FALSE(job->done());
  EXPECT_EQ(stats_->value.items, 0u);
}

TEST_F(SchedulerTest, AStalledProducerIsGivenUpOnAndItsLateAnswersAreDropped) {
  auto stalling = answering();
  stalling->stall_after = 1;  // answers its first chunk, then holds every answer
  auto opts = small_chunks();
  opts.work_timeout = 20ms;
  opts.speculative = false;  // the held chunks must be given up on, not overtaken
  start({answering(), stalling}, opts, /*remote=*/{1});
  auto job = submit(100, {});
  sched_.run();
  ASSERT_FALSE(job->done());  // the ordered window waits for the held chunk
  ASSERT_FALSE(stalling->held.empty());
  // work_timeout counts real time (the scheduler's steady clock); the check itself is a
  // delayed message on CAF's test clock.
  std::this_thread::sleep_for(40ms);
  while (!job->done() && sched_.trigger_timeout()) sched_.run();
  ASSERT_TRUE(job->done());
  EXPECT_EQ(job->error(), nullptr);
  EXPECT_EQ(*seen_, test_util::iota(100));
  EXPECT_GE(job->report().redispatched, 1u);
  EXPECT_FALSE(stats_->value.producers[1].alive);  // a node's producer is lost, not replaced
  // The late answers arrive now: dropped, nothing delivered twice.
  caf::anon_send(producers_[1], release_atom::value);
  sched_.run();
  EXPECT_TRUE(stalling->held.empty());
  EXPECT_EQ(*seen_, test_util::iota(100));
}

TEST_F(SchedulerTest, ACancelledJobSendsNothingMoreAndTheNextJobRuns) {
  auto stalling = answering();
  stalling->stall_after = 1;
  auto opts = small_chunks();
  opts.speculative = false;  // no copy of the held chunk: the job waits until cancelled
  start({answering(), stalling}, opts, /*remote=*/{1});
  auto first = submit(1000, {});
  sched_.run();  // producer 1 holds a chunk: the ordered job cannot finish
  ASSERT_FALSE(first->done());
  auto sent_before = states_[0]->firsts.size() + stalling->firsts.size();
  caf::anon_send(scheduler_, troupe::cancel_atom::value, std::uint64_t{1});
  sched_.run();
  ASSERT_TRUE(first->done());
  EXPECT_NE(first->error(), nullptr);
  EXPECT_EQ(states_[0]->firsts.size() + stalling->firsts.size(), sent_before);
  // The next job runs on producer 0 (producer 1 still holds its answers).
  seen_->clear();
  auto second = submit(50, {});
  sched_.run();
  ASSERT_TRUE(second->done());
  EXPECT_EQ(second->error(), nullptr);
  EXPECT_EQ(*seen_, test_util::iota(50));
}

// A stream's consumer holds back the acknowledgement of a chunk pushed into a full buffer until
// the reader makes room. The reader's room message may come after another chunk has filled the
// buffer again: the held chunk must still be acknowledged once the reader reads on, or the
// scheduler waits for it for ever (a rare hang of an ordered stream, seen in
// Jobs.StreamGivesOutputsInInputOrder).
TEST_F(SchedulerTest, AStreamsHeldChunkIsTakenWhenTheBufferFillsAgainBeforeTheRoomMessage) {
  auto buf = std::make_shared<troupe::detail::stream_buffer>(1);
  troupe::detail::job_core job{1, caf::actor{}};
  auto gate = job.gate();
  auto consumer = troupe::detail::spawn_stream_consumer(sys_, buf, gate);
  auto chunk = [](std::int64_t x) {
    troupe::consume_chunk c;
    c.run = 1;
    c.items = batch::of(std::vector<std::int64_t>{x});
    return c;
  };
  caf::anon_send(consumer, troupe::init_atom::value);
  caf::anon_send(consumer, chunk(0));  // fits: taken at once
  caf::anon_send(consumer, chunk(1));  // beyond the capacity: held
  sched_.run();
  ASSERT_EQ(gate->chunks_done(), 1u);
  auto value = [&] {
    auto b = buf->pop(job);
    return b ? b->as<std::int64_t>()->items.at(0) : -1;
  };
  EXPECT_EQ(value(), 0);
  caf::anon_send(consumer, chunk(2));  // queued ahead of the room message the next pop sends
  EXPECT_EQ(value(), 1);
  sched_.run();  // chunk 2 fills the buffer again before the room message is handled
  EXPECT_EQ(value(), 2);
  sched_.run();
  // The reader has read all three: each was taken.
  EXPECT_EQ(gate->chunks_done(), 3u);
  caf::anon_send(consumer, troupe::end_atom::value);
  sched_.run();
}
