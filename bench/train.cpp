// Training benchmarks (BENCHMARKS.md, "Training"), beside bench/train_peers.py (gloo allreduce,
// PyTorch DDP):
//   reduce   gradient reduction of M MiB among N replicas: one step whose backward only fills the
//            gradient, so that the step is the reduction (shipping, summing once, sending the
//            result back, applying it); local replicas, and replicas on N node processes
//   model    steps per second of the train example's model (fast and --deterministic)
//   loss     time from a replica's loss to the step's completion: a node that SIGKILLs itself
//            inside a step, and a node frozen (SIGSTOP) inside one
//
//   troupe_train_bench reduce --replicas 2 --mib 1 16 64 [--nodes]
//   troupe_train_bench model --replicas 2 --steps 300 --batch 64 --shard 16
//   troupe_train_bench loss
#include <ATen/Parallel.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <thread>
#include <troupe/node.hpp>

#include "child_node.hpp"
#include "common/classifier.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t).count();
}

double median(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  return xs[xs.size() / 2];
}

/// A replica whose only parameter is M MiB of floats and whose backward just fills its gradient:
/// a step of this job is the gradient reduction itself.
struct reduce_probe {
  struct replica {
    replica(const troupe::device&, const troupe::config& cfg)
        : p(torch::zeros({cfg.get_or<std::int64_t>("mib", 1) << 18}).requires_grad_()) {}
    std::vector<torch::Tensor> parameters() { return {p}; }
    double backward(const std::vector<std::int32_t>& shard) {
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
      p.grad().fill_(static_cast<float>(shard.at(0)));
      return 0;
    }
    void step() {}
    torch::Tensor p;
  };
};

}  // namespace

TROUPE_REGISTER_JOB(reduce_probe);
TROUPE_REGISTER_JOB(example::classifier);

int main(int argc, char** argv) {
  CLI::App app{"troupe training benchmarks"};
  std::string serve, devices = "cpu";
  app.add_option("--serve", serve, "run as a node (used by the benchmark itself)");
  app.add_option("--devices", devices, "the node's devices");
  std::size_t replicas = 2, iters = 10, steps = 300, batch = 64, shard = 16;
  std::vector<std::size_t> mib{1, 16, 64};
  bool nodes = false;
  auto* reduce = app.add_subcommand("reduce", "gradient reduction of M MiB among N replicas");
  reduce->add_option("--replicas", replicas);
  reduce->add_option("--mib", mib);
  reduce->add_option("--iters", iters);
  reduce->add_flag("--nodes", nodes, "replicas on node processes over loopback");
  bool caf_ring = false;
  reduce->add_flag("--caf-ring", caf_ring,
                   "nodes: the ring's data through CAF (train_options::direct_ring off)");
  auto* model = app.add_subcommand("model", "steps per second of the train example's model");
  model->add_option("--replicas", replicas);
  model->add_option("--steps", steps);
  model->add_option("--batch", batch);
  model->add_option("--shard", shard);
  model->add_flag("--nodes", nodes, "replicas on node processes over loopback");
  auto* loss = app.add_subcommand("loss", "time from a replica's loss to the step's completion");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);

  if (!serve.empty()) {
    example::serving() = true;
    auto node = troupe::node::serve(serve, {troupe::device{devices}});
    std::printf("serving on %s\n", node.address().c_str());
    std::fflush(stdout);
    pause();
    return 0;
  }

  // N node processes (each one replica), or N local CPU devices.
  std::vector<std::unique_ptr<child_node>> children;
  auto devices_for = [&](std::size_t n, bool remote) {
    std::vector<troupe::device> out;
    for (std::size_t i = 0; i < n; ++i) {
      if (!remote) {
        out.emplace_back("cpu");
        continue;
      }
      children.push_back(std::make_unique<child_node>(argv[0], "cpu"));
      out.emplace_back(children.back()->address + "/cpu");
    }
    return out;
  };

  if (*reduce) {
    auto devs = devices_for(replicas, nodes);
    for (auto m : mib) {
      troupe::config cfg;
      cfg.set("mib", m);
      troupe::train_options o;
      o.shard_size = 1;
      o.direct_ring = !caf_ring;
      troupe::data_parallel<reduce_probe> dp{devs, cfg, o};
      std::vector<std::int32_t> samples(replicas, 1);  // one shard per replica
      for (int i = 0; i < 3; ++i) dp.step(samples);
      std::vector<double> ms, reduce_ms;
      for (std::size_t i = 0; i < iters; ++i) {
        auto before = dp.stats().reduce_seconds;
        auto t = clock_type::now();
        dp.step(samples);
        ms.push_back(ms_since(t));
        reduce_ms.push_back((dp.stats().reduce_seconds - before) * 1e3);
      }
      auto med = median(ms);
      std::printf(
          "troupe reduce %s replicas=%zu mib=%zu median_ms=%.3f algbw_gbs=%.3f "
          "(of which summing and applying %.3f ms; %s)\n",
          nodes ? "nodes" : "local", replicas, m, med,
          static_cast<double>(m << 20) / (med * 1e-3) / 1e9, median(reduce_ms),
          dp.stats().direct_ring_reductions > 0 ? "ring over direct connections"
          : dp.stats().ring_reductions > 0      ? "ring through CAF"
                                                : "through the coordinator");
    }
  }

  if (*model) {
    auto devs = devices_for(replicas, nodes);
    auto data = example::make_data(batch * 64, 0, 4, 32, 7);
    troupe::config cfg;
    for (bool det : {false, true}) {
      troupe::train_options o;
      o.shard_size = shard;
      o.deterministic = det;
      troupe::data_parallel<example::classifier> dp{devs, cfg, o};
      std::vector<std::vector<example::sample>> batches;
      for (std::size_t i = 0; i + batch <= data.train.size(); i += batch)
        batches.emplace_back(data.train.begin() + static_cast<std::ptrdiff_t>(i),
                             data.train.begin() + static_cast<std::ptrdiff_t>(i + batch));
      for (std::size_t i = 0; i < 20; ++i) dp.step(batches[i % batches.size()]);
      auto t = clock_type::now();
      for (std::size_t i = 0; i < steps; ++i) dp.step(batches[i % batches.size()]);
      auto secs = ms_since(t) / 1e3;
      std::printf("troupe model %s replicas=%zu batch=%zu shard=%zu %s steps_per_s=%.1f\n",
                  nodes ? "nodes" : "local", replicas, batch, shard, det ? "deterministic" : "fast",
                  static_cast<double>(steps) / secs);
    }
  }

  if (*loss) {
    // One local replica and one on a node; shards sleep 5 ms (a device busy for 40 ms a step).
    auto data = example::make_data(64 * 40, 0, 4, 32, 7);
    std::vector<std::vector<example::sample>> batches;
    for (std::size_t i = 0; i + 64 <= data.train.size(); i += 64)
      batches.emplace_back(data.train.begin() + static_cast<std::ptrdiff_t>(i),
                           data.train.begin() + static_cast<std::ptrdiff_t>(i + 64));
    for (int sig : {SIGKILL, SIGSTOP}) {
      child_node node{argv[0], "cpu"};
      troupe::config cfg;
      cfg.set("fault.sleep_ms", 5);
      if (sig == SIGKILL) cfg.set("fault.exit_at_shard", 3 * 4 + 2);  // inside the 4th step
      troupe::train_options o;
      o.shard_size = 8;
      o.deterministic = true;
      troupe::data_parallel<example::classifier> dp{{"cpu", node.address + "/cpu"}, cfg, o};
      std::vector<double> ms;
      double worst = 0;
      for (std::size_t i = 0; i < 10; ++i) {
        if (sig == SIGSTOP && i == 3) {
          std::thread([pid = node.pid] {
            std::this_thread::sleep_for(std::chrono::milliseconds{10});
            kill(pid, SIGSTOP);
          }).detach();
        }
        auto t = clock_type::now();
        auto lost = dp.stats().lost_replicas;
        dp.step(batches[i]);
        auto took = ms_since(t);
        if (dp.stats().lost_replicas > lost)
          worst = took;
        else
          ms.push_back(took);
      }
      std::printf(
          "troupe loss %s: step with the loss %.1f ms, other steps median %.1f ms "
          "(lost %llu, recomputed shards %llu)\n",
          sig == SIGKILL ? "SIGKILL" : "SIGSTOP (frozen)", worst, median(ms),
          static_cast<unsigned long long>(dp.stats().lost_replicas),
          static_cast<unsigned long long>(dp.stats().recomputed_shards));
      if (sig == SIGSTOP) kill(node.pid, SIGCONT);
    }
    // Fast mode, 3 node processes, hidden 1024 (a 4.2 MiB gradient): rings over the replicas'
    // direct connections. One node is SIGKILLed during step 6, aimed at the middle of its ring
    // (the median step time minus half the median ring time after the step starts, moved later
    // by a quarter of a ring per try until a try's kill landed inside a ring: that ring failed,
    // so one step fewer was reduced in a ring).
    for (int attempt = 0; attempt < 8; ++attempt) {
      std::vector<std::unique_ptr<child_node>> nodes;
      std::vector<troupe::device> devs;
      for (int i = 0; i < 3; ++i) {
        nodes.push_back(std::make_unique<child_node>(argv[0], "cpu"));
        devs.emplace_back(nodes.back()->address + "/cpu");
      }
      troupe::config cfg;
      cfg.set("model.hidden", std::int64_t{1024});
      troupe::train_options o;
      o.shard_size = 8;
      troupe::data_parallel<example::classifier> dp{devs, cfg, o};
      std::vector<double> ms, ring_ms;
      double worst = 0;
      for (std::size_t i = 0; i < 12; ++i) {
        if (i == 6) {
          auto at = median(ms) - median(ring_ms) * (0.5 - 0.25 * attempt);
          std::thread([pid = nodes[1]->pid, at] {
            std::this_thread::sleep_for(std::chrono::microseconds{static_cast<long>(at * 1e3)});
            kill(pid, SIGKILL);
          }).detach();
        }
        auto before = dp.stats();
        auto t = clock_type::now();
        dp.step(batches[i]);
        auto took = ms_since(t);
        if (dp.stats().lost_replicas > before.lost_replicas) {
          worst = took;
        } else if (i < 6) {
          ms.push_back(took);
          ring_ms.push_back((dp.stats().reduce_seconds - before.reduce_seconds) * 1e3);
        }
      }
      auto s = dp.stats();
      if (s.ring_reductions == s.steps && attempt < 7) continue;  // the kill missed the ring
      std::printf(
          "troupe loss SIGKILL inside a ring over direct connections (3 nodes, 4.2 MiB, try %d): "
          "step with the loss %.1f ms, steps before it median %.1f ms (of which the ring %.1f "
          "ms); lost %llu, recomputed shards %llu, steps %llu, rings %llu, over direct "
          "connections %llu\n",
          attempt + 1, worst, median(ms), median(ring_ms),
          static_cast<unsigned long long>(s.lost_replicas),
          static_cast<unsigned long long>(s.recomputed_shards),
          static_cast<unsigned long long>(s.steps),
          static_cast<unsigned long long>(s.ring_reductions),
          static_cast<unsigned long long>(s.direct_ring_reductions));
      break;
    }
  }
  return 0;
}
