// A node program for the node tests: serves remote_squares, remote_blobs (and remote_tensors, and
// the training tests' seeded_classifier) with the examples' flags
// (--serve HOST:PORT --devices LIST [--tls-cert F --tls-key F --tls-ca F]).
#include "common/cli.hpp"
#include "remote_jobs.hpp"
#ifdef TROUPE_WITH_TORCH
#include "train_jobs.hpp"
#endif

TROUPE_REGISTER_JOB(remote_squares);
TROUPE_REGISTER_JOB(remote_folded_squares);
TROUPE_REGISTER_JOB(remote_batch_squares);
TROUPE_REGISTER_JOB(remote_blobs);
TROUPE_REGISTER_JOB(remote_index);
#ifdef TROUPE_WITH_TORCH
TROUPE_REGISTER_JOB(remote_tensors);
TROUPE_REGISTER_JOB(seeded_classifier);  // training replicas whose optimizer cannot travel
#endif

/// Registered here as int64 -> int64; the node tests register another "mismatched".
struct mismatched {
  struct producer {
    std::int64_t work(std::int64_t x) { return x; }
  };
};
TROUPE_REGISTER_JOB(mismatched);

int main(int argc, char** argv) {
  CLI::App app{"troupe test node"};
  example::flags f;
  example::add_flags(app, f);
  CLI11_PARSE(app, argc, argv);
  if (f.serve.empty()) {
    std::cerr << "usage: troupe_test_node --serve HOST:PORT --devices LIST\n";
    return 2;
  }
  return example::check_flags(f);
}
