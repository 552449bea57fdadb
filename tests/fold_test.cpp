// Folding on the producers (docs/api.md, "Folding on the producers: consumer::merge"): a job
// whose consumer has merge() gets its chunks' outputs folded on local producers into consumers
// of its own, which the job's consumer merges, in input order on an ordered runner. Counted:
// consumers made, merges, work() calls on either side; the errors of every member; the cases
// that do not fold (an error policy, a stream, options::serialize). fold_cancel_test.cpp: a
// cancel that stops the folding producers; a lent range taken back while they fold.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "test_jobs.hpp"
#include "test_util.hpp"
#include "troupe/troupe.hpp"

using test_util::iota;
using test_util::watchdog;
using namespace std::chrono_literals;

namespace {

/// Keeps every output, in the order it saw them; merge() appends the other's: the result shows
/// the order in which outputs reached the job's consumer, chunks folded or not.
struct keeps_order {
  static inline std::atomic<int> made{0};
  static inline std::atomic<int> merges{0};
  static inline std::atomic<std::uint64_t> merged_items{0};
  static void reset() {
    made = 0;
    merges = 0;
    merged_items = 0;
  }
  struct producer {
    std::int64_t work(std::int64_t x) { return 3 * x; }
  };
  struct consumer {
    consumer() { ++made; }
    void work(std::int64_t y) { ys.push_back(y); }
    void merge(consumer&& other) {
      ++merges;
      merged_items += other.ys.size();
      ys.insert(ys.end(), other.ys.begin(), other.ys.end());
    }
    std::vector<std::int64_t> end() { return std::move(ys); }
    std::vector<std::int64_t> ys;
  };
};

std::vector<std::int64_t> tripled(std::int64_t n) {
  auto v = iota(n);
  for (auto& x : v) x *= 3;
  return v;
}

troupe::options fixed_chunks(std::size_t n) {
  troupe::options o;
  o.chunk_size = n;
  return o;
}

TEST(Fold, AnOrderedRunnerMergesEveryChunkInInputOrder) {
  watchdog dog{60s, "folding, ordered"};
  auto o = fixed_chunks(1000);
  o.speculative = false;  // a copy's consumer would be made and never merged
  troupe::ordered_runner<keeps_order> runner{3, {}, o};
  auto xs = iota(100'000);
  keeps_order::reset();
  auto h = runner.submit(troupe::lend(xs));  // read in place, in blocks under its lease
  EXPECT_EQ(h.get(), tripled(100'000));
  // One merge per chunk of 1000, and one more for each late chunk split for an idle producer at
  // the job's end (its items not started went to another producer, folded there).
  EXPECT_GE(keeps_order::merges, 100) << "one merge per chunk of 1000";
  EXPECT_EQ(keeps_order::made, keeps_order::merges + 1) << "the job's consumer and one per part";
  EXPECT_EQ(keeps_order::merged_items, 100'000u);
  EXPECT_EQ(h.report().delivered, 100'000u);
  keeps_order::reset();
  EXPECT_EQ(runner.run(iota(100'000)), tripled(100'000));  // an rvalue: not lent
  EXPECT_GE(keeps_order::merges, 100);
  EXPECT_EQ(keeps_order::merged_items, 100'000u);
  keeps_order::reset();
  std::int64_t next = 0;
  auto gen = troupe::generate([&]() -> std::optional<std::int64_t> {
    if (next == 5000) return std::nullopt;
    return next++;
  });
  EXPECT_EQ(runner.run(gen), tripled(5000));
  EXPECT_GE(keeps_order::merges, 5);
  EXPECT_EQ(keeps_order::merged_items, 5000u);
}

TEST(Fold, AnUnorderedRunnerMergesEveryOutputOnce) {
  watchdog dog{60s, "folding, unordered"};
  troupe::unordered_runner<keeps_order> runner{3, {}, fixed_chunks(1000)};
  auto xs = iota(100'000);
  keeps_order::reset();
  auto ys = runner.run(xs);
  std::sort(ys.begin(), ys.end());
  EXPECT_EQ(ys, tripled(100'000));
  EXPECT_GE(keeps_order::merges, 100);  // and one more for each late chunk split
  EXPECT_EQ(keeps_order::merged_items, 100'000u);
  std::uint64_t done = 0;
  for (auto& p : runner.stats().producers) done += p.items;
  EXPECT_EQ(done, 100'000u);
}

TEST(Fold, AutomaticChunksOverALentRangeFoldEveryItemOnce) {
  watchdog dog{60s, "folding, automatic chunks"};
  troupe::ordered_runner<keeps_order> runner{2};
  auto xs = iota(2'000'000);
  for (int round = 0; round < 3; ++round) {  // the producers' pace learned, then guided chunks
    keeps_order::reset();
    EXPECT_EQ(runner.run(xs), tripled(2'000'000));
    EXPECT_EQ(keeps_order::merged_items, 2'000'000u);
  }
}

/// Items that are not numbers: read from the chunk itself, a few hundred at a time.
struct joins_words {
  static inline std::atomic<int> merges{0};
  struct producer {
    std::string work(const std::string& s) { return "<" + s + ">"; }
  };
  struct consumer {
    void work(std::string y) { all += y; }
    void merge(consumer&& other) {
      ++merges;
      all += other.all;
    }
    std::string end() { return std::move(all); }
    std::string all;
  };
};

TEST(Fold, ItemsThatAreNotNumbersFoldInOrderToo) {
  watchdog dog{60s, "folding strings"};
  troupe::ordered_runner<joins_words> runner{2, {}, fixed_chunks(700)};
  std::vector<std::string> words;
  std::string want;
  for (int i = 0; i < 5000; ++i) {
    words.push_back(std::to_string(i));
    want += "<" + words.back() + ">";
  }
  joins_words::merges = 0;
  EXPECT_EQ(runner.run(words), want);
  EXPECT_GE(joins_words::merges, 8);  // a chunk of 700 each, and a part for each split
}

/// Throws from the member `where` names (config "throw_in") at the value 3 * 5000.
struct throws_somewhere {
  static inline std::string where;
  struct producer {
    std::int64_t work(std::int64_t x) {
      if (where == "producer" && x == 5000) throw std::runtime_error("producer says no");
      return 3 * x;
    }
  };
  struct consumer {
    void work(std::int64_t y) {
      if (where == "work" && y == 15000) throw std::runtime_error("consumer says no");
      sum += y;
    }
    void merge(consumer&& other) {
      if (where == "merge") throw std::runtime_error("merge says no");
      sum += other.sum;
    }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

std::string error_of(const char* where, troupe::error_policy policy = {}) {
  throws_somewhere::where = where;
  troupe::unordered_runner<throws_somewhere> runner{2, {}, fixed_chunks(1000)};
  auto xs = iota(20'000);
  troupe::job_options o;
  o.on_error = policy;
  try {
    runner.run(xs, o);
  } catch (const troupe::consumer_error& e) {
    return std::string{"consumer_error: "} + e.what();
  } catch (const troupe::work_error& e) {
    return "work_error at " + std::to_string(e.index()) + " on " + e.where() + ": " + e.what();
  }
  return "no error";
}

TEST(Fold, EveryMembersThrowReachesTheCaller) {
  watchdog dog{60s, "folding errors"};
  auto work = error_of("work");
  EXPECT_EQ(work.rfind("consumer_error: consumer::work threw on a producer folding a chunk for "
                       "consumer::merge (item 5000): ",
                       0),
            0u)
      << work;
  EXPECT_NE(work.find("consumer says no"), std::string::npos) << work;
  EXPECT_NE(work.find("(on cpu, producer "), std::string::npos) << work;
  auto merge = error_of("merge");
  EXPECT_EQ(merge.rfind("consumer_error: consumer::merge threw: ", 0), 0u) << merge;
  EXPECT_NE(merge.find("merge says no"), std::string::npos) << merge;
  auto producer = error_of("producer");
  EXPECT_EQ(producer.rfind("work_error at 5000 on cpu: ", 0), 0u) << producer;
  EXPECT_NE(producer.find("producer says no"), std::string::npos) << producer;
  // With a policy that goes on after a throw nothing is folded: the consumer's own work() on
  // the consumer's thread throws (there is no folding producer in its message).
  auto skipped = error_of("work", troupe::error_policy::skip());
  EXPECT_EQ(skipped.rfind("consumer_error: consumer::work threw: ", 0), 0u) << skipped;
}

/// The consumer's constructor throws when made on a producer's thread (a job's consumer is
/// made on the consumer's pool, which never runs producers).
struct constructor_throws_on_producers {
  static inline thread_local bool producer_thread = false;
  struct producer {
    producer() { producer_thread = true; }
    std::int64_t work(std::int64_t x) { return x; }
  };
  struct consumer {
    consumer() {
      if (producer_thread) throw std::runtime_error("not here");
    }
    void work(std::int64_t y) { sum += y; }
    void merge(consumer&& other) { sum += other.sum; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

TEST(Fold, AConstructorThatThrowsOnAProducerIsAConsumerError) {
  watchdog dog{60s, "folding: a constructor that throws"};
  troupe::unordered_runner<constructor_throws_on_producers> runner{1, {}, fixed_chunks(100)};
  auto xs = iota(1000);
  try {
    runner.run(xs);
    ADD_FAILURE() << "no consumer_error";
  } catch (const troupe::consumer_error& e) {
    EXPECT_NE(std::string{e.what()}.find("consumer::consumer (constructor) threw on a producer "
                                         "folding a chunk for consumer::merge: "),
              std::string::npos)
        << e.what();
  }
}

TEST(Fold, NothingIsFoldedWithAnErrorPolicyAStreamOrSerialize) {
  watchdog dog{60s, "no folding"};
  auto xs = iota(10'000);
  {
    troupe::ordered_runner<keeps_order> runner{2, {}, fixed_chunks(1000)};
    keeps_order::reset();
    troupe::job_options o;
    o.on_error = troupe::error_policy::retry(2);
    EXPECT_EQ(runner.run(xs, o), tripled(10'000));
    EXPECT_EQ(keeps_order::merges, 0);
    EXPECT_EQ(keeps_order::made, 1);
    std::vector<std::int64_t> streamed;
    for (auto y : runner.stream(xs)) streamed.push_back(y);
    EXPECT_EQ(streamed, tripled(10'000));
    EXPECT_EQ(keeps_order::merges, 0);
  }
  auto opts = fixed_chunks(1000);
  opts.serialize = true;  // a local run as over a network: outputs cross the wire format
  troupe::ordered_runner<keeps_order> runner{2, {}, opts};
  keeps_order::reset();
  EXPECT_EQ(runner.run(xs), tripled(10'000));
  EXPECT_EQ(keeps_order::merges, 0);
}

}  // namespace
