// cuda_kernel: each producer launches its own CUDA kernel on its own stream.
// Without a GPU it says so and exits cleanly.
//
//   vector ──▶ producer: H2D (pinned, async) → square kernel → D2H on its stream ──▶ sum
#include <iostream>
#include <numeric>
#include <stdexcept>
#include <troupe/device_binding.hpp>

#include "common/cli.hpp"
#include "cuda_kernel_ops.hpp"

namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string{what} + ": " + cudaGetErrorString(e));
}
}  // namespace

struct square_on_gpu {
  struct producer {
    explicit producer(const troupe::device&) {
      stream = static_cast<cudaStream_t>(troupe::current_stream());
      check(cudaMallocHost(reinterpret_cast<void**>(&host), capacity * sizeof(float)),
            "cudaMallocHost");
      check(cudaMalloc(reinterpret_cast<void**>(&dev_in), capacity * sizeof(float)), "cudaMalloc");
      check(cudaMalloc(reinterpret_cast<void**>(&dev_out), capacity * sizeof(float)), "cudaMalloc");
    }
    ~producer() {
      cudaFreeHost(host);
      cudaFree(dev_in);
      cudaFree(dev_out);
    }
    double work(const std::vector<float>& xs) {
      if (xs.size() > capacity) throw std::invalid_argument("vector too long");
      auto bytes = xs.size() * sizeof(float);
      std::copy(xs.begin(), xs.end(), host);
      check(cudaMemcpyAsync(dev_in, host, bytes, cudaMemcpyHostToDevice, stream), "H2D");
      check(launch_square(dev_in, dev_out, static_cast<int>(xs.size()), stream), "kernel");
      check(cudaMemcpyAsync(host, dev_out, bytes, cudaMemcpyDeviceToHost, stream), "D2H");
      check(cudaStreamSynchronize(stream), "sync");
      return std::accumulate(host, host + xs.size(), 0.0);
    }
    static constexpr std::size_t capacity = 1 << 16;
    cudaStream_t stream = nullptr;
    float* host = nullptr;
    float* dev_in = nullptr;
    float* dev_out = nullptr;
  };
  struct consumer {
    void work(double y) { sum += y; }
    double end() { return sum; }
    double sum = 0;
  };
};
TROUPE_REGISTER_JOB(square_on_gpu);

int main(int argc, char** argv) {
  CLI::App app{"cuda_kernel: producers launch their own CUDA kernel on their own stream"};
  example::flags f;
  f.devices = "";
  example::add_flags(app, f);
  CLI11_PARSE(app, argc, argv);
  if (int rc = example::check_flags(f); rc >= 0) return rc;
  auto devices = f.devices.empty() ? troupe::gpus() : f.device_list();
  if (devices.empty()) {
    std::cout << "no GPU here (no device, no driver, or troupe built without CUDA): nothing to "
                 "run\nresult: skipped\n";
    return 0;
  }
  return example::guarded([&] {
    troupe::unordered_runner<square_on_gpu> runner{devices, {}, f.options()};
    std::vector<std::vector<float>> inputs(f.items, std::vector<float>(1000, 2.0f));
    std::cout << "result: " << runner.run(inputs) << "\n";  // items * 1000 * 4
  });
}
