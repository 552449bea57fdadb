// inference: a torch::nn MLP replicated on every device; rows streamed one at a time,
// outputs concatenated in input order (seed example 2).
//
//   row i ──▶ producer: model(row) on its device ──▶ consumer: stack in order ──▶ checksum
#include "common/cli.hpp"
#include "common/mlp.hpp"

struct inference {
  struct producer : example::mlp_replica {
    explicit producer(const troupe::device& d) : mlp_replica(d) {}
    at::Tensor work(const at::Tensor& row) { return forward(row.unsqueeze(0)).squeeze(0); }
  };
  struct consumer {
    void work(at::Tensor y) { rows.push_back(troupe::to_host(y)); }
    at::Tensor end() { return rows.empty() ? torch::empty({0, 4}) : torch::stack(rows); }
    std::vector<at::Tensor> rows;
  };
};
TROUPE_REGISTER_JOB(inference);

int main(int argc, char** argv) {
  CLI::App app{"inference: an MLP on every device, rows streamed one at a time"};
  example::flags f;
  f.ordered = true;
  example::add_flags(app, f);
  CLI11_PARSE(app, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;
  return example::guarded([&] {
    torch::manual_seed(1);
    auto inputs = torch::randn({static_cast<std::int64_t>(f.items), example::mlp_features});
    std::vector<at::Tensor> rows = inputs.unbind(0);
    auto progress = f.make_progress();  // on stderr (common/progress.hpp)
    troupe::ordered_runner<inference> runner{f.device_list(), {}, f.options(progress)};
    auto watching = progress.watch(runner);
    auto outputs = runner.run(rows);
    progress.finish();
    example::check_and_report(outputs, inputs);
  });
}
