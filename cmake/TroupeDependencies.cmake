# Finds troupe's dependencies (the core needs CAF, OpenSSL and Threads; troupe::torch LibTorch and,
# for CUDA producers, the CUDA toolkit). Sets TROUPE_HAVE_TORCH, TROUPE_HAVE_TORCH_CUDA and
# TROUPE_HAVE_CUDART.
find_package(Threads REQUIRED)
find_package(CAF 0.17 REQUIRED)
find_package(OpenSSL REQUIRED)

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
    # Guard against a LibTorch assembled from two installations (the wheel's headers with a
    # system libc10, say): tools/build.sh points CMAKE_LIBRARY_PATH at the wheel.
    get_filename_component(_troupe_torch_root "${Torch_DIR}/../../.." ABSOLUTE)
    foreach(_lib IN LISTS TORCH_LIBRARIES)
      if(_lib MATCHES "libc10" AND NOT _lib MATCHES "^${_troupe_torch_root}")
        message(WARNING "troupe: ${_lib} is not from the LibTorch at ${_troupe_torch_root}; "
                        "pass -DCMAKE_LIBRARY_PATH=${_troupe_torch_root}/lib")
      endif()
    endforeach()
    if(TARGET torch_cuda OR TORCH_CUDA_LIBRARIES)
      set(TROUPE_HAVE_TORCH_CUDA ON)
    endif()
    include(TroupeTorchLinks)
  endif()
endif()
message(STATUS "troupe: LibTorch ${TROUPE_HAVE_TORCH} (CUDA ${TROUPE_HAVE_TORCH_CUDA}), "
               "CUDA runtime ${TROUPE_HAVE_CUDART}")
