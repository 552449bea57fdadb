// batched_inference: the inference example over batches pulled from a generator (seed
// example 3). The generator makes each batch only when a producer has room for it.
//
//   generate(batch) ──▶ producer: model(batch) ──▶ consumer: cat in order ──▶ checksum
#include "common/cli.hpp"
#include "common/mlp.hpp"

struct batched_inference {
  struct producer : example::mlp_replica {
    explicit producer(const troupe::device& d) : mlp_replica(d) {}
    at::Tensor work(const at::Tensor& batch) { return forward(batch); }
  };
  struct consumer {
    void work(at::Tensor y) { parts.push_back(troupe::to_host(y)); }
    at::Tensor end() { return parts.empty() ? torch::empty({0, 4}) : torch::cat(parts); }
    std::vector<at::Tensor> parts;
  };
};
TROUPE_REGISTER_JOB(batched_inference);

int main(int argc, char** argv) {
  CLI::App app{"batched_inference: an MLP on every device over generated batches"};
  example::flags f;
  f.ordered = true;
  std::int64_t batch = 32;
  example::add_flags(app, f);
  app.add_option("--batch", batch, "rows per batch")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1'000'000}));
  CLI11_PARSE(app, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;
  return example::guarded([&] {
    const auto rows = static_cast<std::int64_t>(f.items);
    torch::manual_seed(1);
    auto inputs = torch::randn({rows, example::mlp_features});
    std::int64_t next = 0;
    auto progress = f.make_progress("batches");  // on stderr (common/progress.hpp)
    troupe::ordered_runner<batched_inference> runner{f.device_list(), {}, f.options(progress)};
    auto watching = progress.watch(runner);
    progress.expect(static_cast<std::uint64_t>((rows + batch - 1) / batch));
    auto outputs = runner.run(troupe::generate([&]() -> std::optional<at::Tensor> {
      if (next >= rows) return std::nullopt;
      auto b = inputs.slice(0, next, std::min(next + batch, rows));
      next += batch;
      return b;
    }));
    progress.finish();
    example::check_and_report(outputs, inputs);
  });
}
