# Finds troupe's dependencies. Sets TROUPE_HAVE_TORCH, TROUPE_HAVE_TORCH_CUDA and
# TROUPE_HAVE_CUDART.
find_package(Threads REQUIRED)
find_package(CAF 0.17 REQUIRED)

set(TROUPE_HAVE_CUDART OFF)
find_package(CUDAToolkit QUIET)
if(CUDAToolkit_FOUND AND TARGET CUDA::cudart_static)
  set(TROUPE_HAVE_CUDART ON)
endif()

set(TROUPE_HAVE_TORCH OFF)
set(TROUPE_HAVE_TORCH_CUDA OFF)
if(TROUPE_WITH_TORCH)
  find_package(Torch QUIET)
  if(Torch_FOUND OR TORCH_FOUND)
    set(TROUPE_HAVE_TORCH ON)
    if(TARGET torch_cuda OR TORCH_CUDA_LIBRARIES)
      set(TROUPE_HAVE_TORCH_CUDA ON)
    endif()
  endif()
endif()
message(STATUS "troupe: LibTorch ${TROUPE_HAVE_TORCH} (CUDA ${TROUPE_HAVE_TORCH_CUDA}), "
               "CUDA runtime ${TROUPE_HAVE_CUDART}")
