// A project outside troupe's tree using the torch component: tensors as items.
#include <ATen/ATen.h>

#include <iostream>
#include <troupe/torch.hpp>
#include <troupe/troupe.hpp>

struct doubled {
  struct producer {
    at::Tensor work(const at::Tensor& x) { return x * 2; }
  };
  struct consumer {
    void work(const at::Tensor& y) { sum += y.sum().item<double>(); }
    double end() { return sum; }
    double sum = 0;
  };
};

int main() {
  troupe::ordered_runner<doubled> runner{2};
  std::vector<at::Tensor> xs;
  for (int i = 1; i <= 3; ++i) xs.push_back(at::full({2}, static_cast<double>(i)));
  std::cout << "gpus: " << troupe::gpus().size() << "\nresult: " << runner.run(xs) << "\n";
}
