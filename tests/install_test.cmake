# Installs troupe into a scratch prefix, then configures, builds and runs a consumer project the
# way a user would (docs/api.md, "Using troupe from CMake"). MODE:
#   core   the core package only, with no Torch on CMAKE_PREFIX_PATH; the program must not link
#          LibTorch (readelf) and must start in well under 50 MB of RSS
#   torch  find_package(troupe COMPONENTS torch) and a job whose items are tensors: Torch found
#          where troupe was built against it; TROUPE_TORCH_DIR pointing elsewhere is obeyed (the
#          component is then not found, with a message naming the variable)
#   moved  the core package from a copy of the install prefix moved elsewhere; no installed file
#          names the build or source tree
set(root ${BUILD_DIR}/install-test-${MODE})
set(prefix ${root}/prefix)
set(app ${root}/app)
file(REMOVE_RECURSE ${root})
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()
step(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
set(project_dir ${SOURCE_DIR}/tests/consumer_project)
set(extra "")
if(MODE STREQUAL "torch")
  set(project_dir ${SOURCE_DIR}/tests/consumer_torch)
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${project_dir} -B ${root}/no-torch
                  "-DCMAKE_PREFIX_PATH=${prefix}" -DTROUPE_TORCH_DIR=${root}/nowhere
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT err MATCHES "TROUPE_TORCH_DIR")
    message(FATAL_ERROR "a wrong TROUPE_TORCH_DIR was not reported:\n${out}\n${err}")
  endif()
elseif(MODE STREQUAL "moved")
  file(RENAME ${prefix} ${root}/elsewhere)
  set(prefix ${root}/elsewhere)
  file(GLOB_RECURSE installed_cmake ${prefix}/*.cmake)
  foreach(f IN LISTS installed_cmake)
    file(READ ${f} text)
    foreach(tree IN ITEMS ${SOURCE_DIR} ${BUILD_DIR} ${root}/prefix)
      string(FIND "${text}" "${tree}" at)
      if(NOT at EQUAL -1)
        message(FATAL_ERROR "${f} names ${tree}: the package is not relocatable")
      endif()
    endforeach()
  endforeach()
endif()
# CMAKE_PREFIX_PATH names troupe's prefix alone: the core must need no Torch.
step(${CMAKE_COMMAND} -S ${project_dir} -B ${app} -DCMAKE_BUILD_TYPE=Release
     "-DCMAKE_PREFIX_PATH=${prefix}" ${extra})
step(${CMAKE_COMMAND} --build ${app})
step(${app}/app)
set(run_output "${step_output}")
message("${run_output}")
if(NOT MODE STREQUAL "torch")
  step(readelf -d ${app}/app)
  if(step_output MATCHES "libtorch|libc10|libcuda")
    message(FATAL_ERROR "the core program links LibTorch or CUDA:\n${step_output}")
  endif()
  string(REGEX MATCH "peak RSS: ([0-9]+) KiB" _ "${run_output}")
  if(NOT CMAKE_MATCH_1 OR CMAKE_MATCH_1 GREATER 51200)
    message(FATAL_ERROR "the core program's peak RSS is not under 50 MB: ${run_output}")
  endif()
  message("core program: no LibTorch in its NEEDED entries, peak RSS ${CMAKE_MATCH_1} KiB")
endif()
