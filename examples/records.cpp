// records: a custom item type crossing to a node — a struct holding a string and a tensor,
// made serializable with inspect() (docs/api.md, "Custom types across the network").
//
//   record{name, values} ──▶ producer (maybe on a node): sum of values ──▶ summary{name, total}
//   ──▶ consumer: checks each name came back in order, adds the totals
#include <ATen/ATen.h>

#include <troupe/torch.hpp>  // at::Tensor's inspect(): tensors travel as dtype, shape, bytes

#include "common/cli.hpp"

namespace app {

struct record {
  std::string name;
  at::Tensor values;
};
// Every field must be named here: a forgotten one arrives empty on a node, silently. Test it
// with troupe::testing::round_trip or options::serialize (docs/api.md).
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, record& x) {
  return f(caf::meta::type_name("app.record"), x.name, x.values);
}

struct summary {
  std::string name;
  double total = 0;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, summary& x) {
  return f(caf::meta::type_name("app.summary"), x.name, x.total);
}

struct records {
  struct producer {
    summary work(const record& r) { return {r.name, r.values.sum().item<double>()}; }
  };
  struct consumer {
    void work(const summary& s) {
      if (s.name != "record-" + std::to_string(seen++))
        throw std::runtime_error("name out of order or lost: '" + s.name + "'");
      total += s.total;
    }
    double end() { return total; }
    std::size_t seen = 0;
    double total = 0;
  };
};

}  // namespace app
TROUPE_REGISTER_JOB(app::records);

int main(int argc, char** argv) {
  CLI::App cli{"records: structs holding a string and a tensor, through nodes"};
  example::flags f;
  example::add_flags(cli, f);
  CLI11_PARSE(cli, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;
  return example::guarded([&] {
    std::vector<app::record> rs;
    for (std::size_t i = 0; i < f.items; ++i)  // record i holds 0, 1, ..., i % 5
      rs.push_back({"record-" + std::to_string(i), at::arange(static_cast<double>(i % 5 + 1))});
    auto progress = f.make_progress();  // on stderr (common/progress.hpp)
    troupe::ordered_runner<app::records> runner{f.device_list(), {}, f.options(progress)};
    auto watching = progress.watch(runner);
    auto total = runner.run(rs);
    progress.finish();
    std::cout << "result: " << total << "\n";
  });
}
