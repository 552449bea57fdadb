// The CUDA kernel of the cuda_kernel example (compiled by nvcc, sm_75 and up).
#include "cuda_kernel_ops.hpp"

namespace {

__global__ void square_kernel(const float* in, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] * in[i];
}

}  // namespace

cudaError_t launch_square(const float* in, float* out, int n, cudaStream_t stream) {
  int threads = 256;
  int blocks = (n + threads - 1) / threads;
  square_kernel<<<blocks, threads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}
