// What the training tests check of parameters: equal bits, flattened, replicas identical.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <troupe/train.hpp>
#include <vector>

namespace train_checks {

/// Shards of `shard` samples, deterministic or not.
inline troupe::train_options opts(std::size_t shard, bool deterministic) {
  troupe::train_options o;
  o.shard_size = shard;
  o.deterministic = deterministic;
  return o;
}

/// Same shape, dtype and bits.
inline bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  auto x = a.contiguous(), y = b.contiguous();
  return x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type() &&
         std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

/// The tensors as one flat tensor, in order.
inline at::Tensor flat(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> parts;
  for (auto& p : ps) parts.push_back(p.reshape(-1));
  return torch::cat(parts);
}

/// Every replica of `dp` holds replica 0's parameters, bit for bit.
template <class DataParallel>
void expect_replicas_identical(DataParallel& dp) {
  auto ps = dp.replica_parameters();
  ASSERT_FALSE(ps.empty());
  for (std::size_t i = 1; i < ps.size(); ++i)
    EXPECT_TRUE(same_bits(ps[0], ps[i])) << "replica " << i << " differs from replica 0";
}

}  // namespace train_checks
