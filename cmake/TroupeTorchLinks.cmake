# Sets TROUPE_TORCH_LINK_OPTIONS from the Torch package just found (Torch_DIR): the PyPI wheel's
# libtorch_cuda needs the wheel's own NCCL, cuDNN ... (found at run time through its RPATH); the
# linker must see them too, before the CUDA toolkit's older copies. Used by troupe's build and by
# troupeConfig.cmake on the user's machine, so that no path of the build machine is installed.
set(TROUPE_TORCH_LINK_OPTIONS "")
if(Torch_DIR)
  get_filename_component(_troupe_site "${Torch_DIR}/../../../.." ABSOLUTE)
  file(GLOB _troupe_wheel_libs "${_troupe_site}/nvidia/*/lib")
  foreach(_dir IN LISTS _troupe_wheel_libs)
    list(APPEND TROUPE_TORCH_LINK_OPTIONS "LINKER:-rpath-link,${_dir}")
  endforeach()
endif()
