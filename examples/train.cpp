// train: data-parallel SGD of an MLP classifier on every device (the seeds' DataParallel/DDP and
// parameter-averaging loops), on data generated from a seed; prints the loss per epoch, a hash of
// the final parameters and the held-out accuracy.
//
//   batch ──▶ shards ──▶ replicas (backward) ──▶ gradients reduced once ──▶ step() everywhere
//
//   train --devices cpu,cpu --epochs 3                    # two local replicas
//   train --serve 127.0.0.1:7000 --devices cpu            # a node holding replicas
//   train --nodes 127.0.0.1:7000 --devices cpu            # one local, one on the node
//   train --average-every 4                               # local steps, averaged every 4 steps
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>

#include "common/classifier.hpp"
#include "common/cli.hpp"

TROUPE_REGISTER_JOB(example::classifier);

int main(int argc, char** argv) {
  CLI::App app{"train: data-parallel SGD of an MLP classifier over devices and nodes"};
  example::flags f;
  example::add_flags(app, f);
  std::size_t epochs = 3, batch_size = 64, shard = 16, samples = 20000, average_every = 0;
  std::size_t features = 32, classes = 4, hidden = 64;
  double lr = 0.05;
  std::string optim = "sgd";
  int threads = 1;
  bool deterministic = false;
  std::int64_t seed = 7, kill_at = 0;
  app.add_option("--epochs", epochs, "passes over the training data");
  app.add_option("--batch", batch_size, "samples per step (the global batch)");
  app.add_option("--shard", shard, "samples per shard: the unit of work and recovery");
  app.add_option("--lr", lr, "learning rate");
  app.add_option("--optim", optim, "sgd (momentum 0.9), adam or adamw")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}));
  app.add_option("--average-every", average_every,
                 "K > 0: every replica steps on its own shards, parameters averaged every K steps");
  app.add_flag("--deterministic", deterministic,
               "results independent of the number, speed and failures of replicas");
  app.add_option("--samples", samples, "training samples (held-out: a quarter of that)");
  app.add_option("--features", features, "features per sample");
  app.add_option("--classes", classes, "classes");
  app.add_option("--hidden", hidden, "hidden units per layer");
  app.add_option("--seed", seed, "seed of the data and the initial parameters");
  app.add_option("--threads", threads, "LibTorch intra-op threads of this process");
  app.add_option("--kill-node-at-shard", kill_at,
                 "fault injection: a node's replica SIGKILLs its own process at this shard");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(threads);
  example::serving() = !f.serve.empty();
  if (int rc = example::check_flags(f); rc >= 0) return rc;
  return example::guarded([&] {
    troupe::config cfg;
    cfg.set("model.features", features).set("model.classes", classes).set("model.hidden", hidden);
    cfg.set("model.seed", seed).set("sgd.lr", lr).set("fault.exit_at_shard", kill_at);
    cfg.set("optim", optim);
    troupe::train_options o;
    o.shard_size = shard;
    o.deterministic = deterministic;
    std::vector<troupe::device> devices;
    if (!f.devices_given && f.nodes.empty()) {
      devices = troupe::gpus();
      if (devices.empty()) devices = troupe::cpus(2);
    } else {
      devices = f.device_list();
    }
    auto data = example::make_data(samples, samples / 4, classes, features,
                                   static_cast<std::uint64_t>(seed));
    troupe::data_parallel<example::classifier> dp{devices, cfg, o};
    std::mt19937_64 rng{static_cast<std::uint64_t>(seed)};
    std::vector<std::size_t> order(data.train.size());
    std::iota(order.begin(), order.end(), 0);
    std::vector<example::sample> batch;
    std::size_t local_steps = 0;
    // Steps on stderr (common/progress.hpp), each replica's share counted in shards.
    auto progress = f.make_progress("steps", "replicas");
    const auto started = std::chrono::steady_clock::now();
    troupe::progress done;
    done.total = epochs * ((order.size() + batch_size - 1) / std::max<std::size_t>(1, batch_size));
    auto report_step = [&] {
      if (!progress.enabled()) return;
      ++done.done;
      done.elapsed_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      done.items_per_second = static_cast<double>(done.done) / std::max(1e-9, done.elapsed_seconds);
      example::producer_shares shares;
      auto st = dp.stats();
      for (std::size_t i = 0; i < st.replicas.size(); ++i) {
        shares.items.emplace_back(i, st.replicas[i].shards);
        if (st.replicas[i].lost) ++shares.lost;
      }
      progress.update(done, std::move(shares));
    };
    for (std::size_t epoch = 1; epoch <= epochs; ++epoch) {
      std::shuffle(order.begin(), order.end(), rng);
      double loss = 0;
      std::size_t steps = 0;
      for (std::size_t start = 0; start < order.size(); start += batch_size) {
        batch.clear();
        for (std::size_t i = start; i < std::min(order.size(), start + batch_size); ++i)
          batch.push_back(data.train[order[i]]);
        if (average_every > 0) {
          loss += dp.local_step(batch);
          if (++local_steps % average_every == 0) dp.average_parameters();
        } else {
          loss += dp.step(batch);
        }
        ++steps;
        report_step();
      }
      if (average_every > 0 && local_steps % average_every != 0) dp.average_parameters();
      progress.print_above([&] {
        std::printf("epoch %zu: loss %.4f (%zu steps on %zu replicas)\n", epoch,
                    loss / static_cast<double>(std::max<std::size_t>(1, steps)), steps,
                    dp.devices().size());
        std::fflush(stdout);
      });
    }
    progress.finish();
    auto s = dp.stats();
    if (s.lost_replicas > 0)
      std::printf("lost replicas: %llu, shards recomputed: %llu\n",
                  static_cast<unsigned long long>(s.lost_replicas),
                  static_cast<unsigned long long>(s.recomputed_shards));
    if (s.ring_reductions > 0)
      std::printf("ring reductions: %llu, over direct connections: %llu\n",
                  static_cast<unsigned long long>(s.ring_reductions),
                  static_cast<unsigned long long>(s.direct_ring_reductions));
    auto params = dp.parameters();
    std::printf("params: %s\n", example::params_hash(params).c_str());
    std::printf("result: %.4f\n", example::accuracy(params, data.test, cfg));
  });
}
