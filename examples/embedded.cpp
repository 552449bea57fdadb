// embedded: troupe inside a CAF application (docs/api.md, "Embedding in applications").
//
// The application has its own caf::actor_system; troupe::add_to(cfg) adds troupe's types to its
// config, and the runner is built on that system: one thread pool serves both. A "front" actor
// takes the application's queries (a vector of numbers: the sum of their squares), checks them,
// and delegates each to runner.actor() as a job; the answer (or the job's error) goes straight
// back to whoever asked. --clients client actors each send --requests queries one after the
// other: many requests in flight at once, and no thread waits for any of them.
//
//   client actors ──query──▶ front ──delegate──▶ runner.actor() ──job──▶ producers ──▶ consumer
//        ▲                                                                              │
//        └─────────────────────────── the sum, or the job's error ◀─────────────────────┘
//
// Prints the number of queries answered, how many were exact, the threads the process had
// before the runner and at the end, and one query whose producer failed (a negative number).
#include <caf/all.hpp>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <string>
#include <troupe/caf.hpp>
#include <troupe/troupe.hpp>
#include <vector>

#include "common/cli.hpp"
#include "common/threads.hpp"

struct squares {
  struct producer {
    std::int64_t work(std::int64_t x) {
      if (x < 0) throw std::domain_error("negative input " + std::to_string(x));
      return x * x;
    }
  };
  struct consumer {
    void work(std::int64_t y) { sum += y; }
    std::int64_t end() { return sum; }
    std::int64_t sum = 0;
  };
};

using query_atom = caf::atom_constant<caf::atom("query")>;

namespace {

std::int64_t sum_of_squares(std::int64_t n) {  // 0² + … + (n-1)²
  return (n - 1) * n * (2 * n - 1) / 6;
}

/// The application's front door: refuses empty queries itself, hands the rest to troupe. The
/// delegated request's answer goes to the client directly, not through the front.
caf::behavior front(caf::event_based_actor* self, caf::actor troupe_runner) {
  return {
      [=](query_atom, std::vector<std::int64_t>& xs) -> caf::result<caf::message> {
        if (xs.empty()) return caf::make_error(caf::sec::invalid_argument, "an empty query");
        return self->delegate(troupe_runner, troupe::submit_atom::value, std::move(xs));
      },
  };
}

struct tally {
  int answered = 0;
  int exact = 0;
};

/// Sends `requests` queries one after the other, each for 0..len-1 with a length of its own,
/// checks each answer, and reports its tally to `main` when done.
void client(caf::event_based_actor* self, caf::actor front_door, caf::actor main, int id,
            int requests, int items, std::shared_ptr<tally> t) {
  if (requests == 0) {
    self->send(main, *t);
    return;
  }
  auto len = 1 + (id * 7919 + requests * 104729) % items;
  std::vector<std::int64_t> xs(static_cast<std::size_t>(len));
  for (std::int64_t i = 0; i < len; ++i) xs[static_cast<std::size_t>(i)] = i;
  self->request(front_door, caf::infinite, query_atom::value, std::move(xs))
      .then(
          [=](std::int64_t sum) {
            ++t->answered;
            if (sum == sum_of_squares(len)) ++t->exact;
            client(self, front_door, main, id, requests - 1, items, t);
          },
          [=](caf::error& e) {
            std::cerr << "client " << id << ": " << self->system().render(e) << "\n";
            ++t->answered;
            client(self, front_door, main, id, requests - 1, items, t);
          });
}

}  // namespace

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(tally)

int main(int argc, char** argv) {
  CLI::App app{"embedded: troupe inside a CAF application, many queries through one runner"};
  int clients = 200, requests = 50, items = 1000;
  std::string devices = "cpu,cpu";
  app.add_option("--clients", clients, "client actors, each with one query in flight")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--requests", requests, "queries per client, one after the other")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--items", items, "a query has 1..items numbers")->check(CLI::Range(1, 1000000));
  app.add_option("--devices", devices, "the runner's producers, e.g. cpu,cpu");
  CLI11_PARSE(app, argc, argv);
  return example::guarded([&] {
    caf::actor_system_config cfg;
    troupe::add_to(cfg);  // troupe's types and CAF's middleman, in the application's config
    caf::actor_system sys{cfg};
    auto before = example::threads_now();
    std::vector<troupe::device> devs;
    for (auto& spec : example::flags::split(devices)) devs.emplace_back(spec);
    troupe::unordered_runner<squares> runner{sys, devs};  // on the application's system
    auto front_door = sys.spawn(front, runner.actor());

    auto started = std::chrono::steady_clock::now();
    caf::scoped_actor self{sys};
    for (int c = 0; c < clients; ++c)
      sys.spawn(client, front_door, caf::actor{self}, c, requests, items,
                std::make_shared<tally>());
    tally all;
    int peak = example::threads_now();
    for (int c = 0; c < clients; ++c)
      self->receive([&](const tally& t) {
        all.answered += t.answered;
        all.exact += t.exact;
        peak = std::max(peak, example::threads_now());
      });
    auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::cout << "answered " << all.answered << " of " << clients * requests << " queries, "
              << all.exact << " exact, in " << secs << " s from " << clients
              << " clients at once\n";
    std::cout << "threads: " << before << " before the runner, " << peak << " at most after\n";

    // A query whose producer fails: the client gets the job's error, as a CAF error.
    self->request(front_door, caf::infinite, query_atom::value, std::vector<std::int64_t>{1, -2, 3})
        .receive([](std::int64_t) { std::cout << "the failing query succeeded?\n"; },
                 [&](caf::error& e) {
                   std::cout << "a failing query: " << troupe::error_text(e) << "\n";
                 });
    self->send_exit(front_door, caf::exit_reason::user_shutdown);
    runner.close();
    std::cout << "result: " << (all.exact == clients * requests ? "all exact" : "WRONG") << "\n";
  });
}
