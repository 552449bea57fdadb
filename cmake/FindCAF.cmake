# Finds CAF 0.17 and wraps it as the imported targets CAF::core, CAF::io and CAF::openssl, the
# names CAF >= 0.18 exports itself.
#
# troupe wants CAF 0.17.6 rebuilt with its patch series (third_party/caf/patches): that is
# what tools/build_caf.sh installs, into TROUPE_CAF_PREFIX (a CMake or environment variable;
# tools/build.sh passes it). With a prefix, headers and libraries come from it ONLY: a Debian
# libcaf-dev installed beside it is never mixed in, and the targets carry no system include
# path, so the patched headers win. Run time loads the patched libraries through the RUNPATH
# CMake writes for their directory (their SONAME, libcaf_*.so.0.17.6, is Debian's too, so the
# RUNPATH is what decides; the patched libraries carry one as well). Without a prefix, the
# system CAF (Debian's
# libcaf-dev) is used with a warning: it builds, but the network hardening is missing.
# Sets CAF_TROUPE_PATCHED when the CAF found carries troupe's patches.
# Only when not set already: under CMake < 3.21 policies (a consumer project's
# cmake_minimum_required(VERSION 3.16)), set(CACHE) would drop the normal variable that
# troupeConfig.cmake sets to the prefix troupe was built with (policy CMP0126).
if(NOT DEFINED TROUPE_CAF_PREFIX)
  set(TROUPE_CAF_PREFIX "$ENV{TROUPE_CAF_PREFIX}" CACHE PATH
      "Prefix of CAF 0.17.6 with troupe's patches (tools/build_caf.sh)")
endif()
# A changed prefix must search again rather than keep the cached results of the old one.
if(NOT "${TROUPE_CAF_PREFIX}" STREQUAL "${_TROUPE_CAF_SEARCHED}")
  unset(CAF_INCLUDE_DIR CACHE)
  unset(CAF_CORE_LIBRARY CACHE)
  unset(CAF_IO_LIBRARY CACHE)
  unset(CAF_OPENSSL_LIBRARY CACHE)
  set(_TROUPE_CAF_SEARCHED "${TROUPE_CAF_PREFIX}" CACHE INTERNAL "")
endif()
if(TROUPE_CAF_PREFIX)
  find_path(CAF_INCLUDE_DIR caf/all.hpp PATHS "${TROUPE_CAF_PREFIX}/include" NO_DEFAULT_PATH)
  foreach(_lib core io openssl)
    string(TOUPPER ${_lib} _LIB)
    find_library(CAF_${_LIB}_LIBRARY caf_${_lib} PATHS "${TROUPE_CAF_PREFIX}/lib"
                 NO_DEFAULT_PATH)
  endforeach()
else()
  find_path(CAF_INCLUDE_DIR caf/all.hpp)
  find_library(CAF_CORE_LIBRARY caf_core)
  find_library(CAF_IO_LIBRARY caf_io)
  find_library(CAF_OPENSSL_LIBRARY caf_openssl)
endif()
if(CAF_INCLUDE_DIR AND EXISTS "${CAF_INCLUDE_DIR}/caf/config.hpp")
  file(STRINGS "${CAF_INCLUDE_DIR}/caf/config.hpp" _caf_version_line REGEX "#define CAF_VERSION [0-9]+")
  string(REGEX MATCH "[0-9]+" _caf_version "${_caf_version_line}")
  if(_caf_version)
    math(EXPR CAF_VERSION_MAJOR "${_caf_version} / 10000")
    math(EXPR CAF_VERSION_MINOR "(${_caf_version} / 100) % 100")
    math(EXPR CAF_VERSION_PATCH "${_caf_version} % 100")
    set(CAF_VERSION "${CAF_VERSION_MAJOR}.${CAF_VERSION_MINOR}.${CAF_VERSION_PATCH}")
  endif()
endif()
set(CAF_TROUPE_PATCHED FALSE)
if(CAF_INCLUDE_DIR AND EXISTS "${CAF_INCLUDE_DIR}/caf/io/basp_broker.hpp")
  file(STRINGS "${CAF_INCLUDE_DIR}/caf/io/basp_broker.hpp" _caf_patch_line
       REGEX "troupe patch 0003")
  if(_caf_patch_line)
    set(CAF_TROUPE_PATCHED TRUE)
  endif()
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CAF
  REQUIRED_VARS CAF_INCLUDE_DIR CAF_CORE_LIBRARY CAF_IO_LIBRARY CAF_OPENSSL_LIBRARY
  VERSION_VAR CAF_VERSION)
if(CAF_FOUND)
  if(NOT CAF_TROUPE_PATCHED AND NOT CAF_FIND_QUIETLY)
    message(WARNING "troupe: CAF at ${CAF_INCLUDE_DIR} lacks troupe's patches "
                    "(third_party/caf/patches): nodes are open to the defects they fix. "
                    "Build it with tools/build_caf.sh and pass -DTROUPE_CAF_PREFIX=<prefix>.")
  endif()
  find_package(Threads REQUIRED)
  if(NOT TARGET CAF::core)
    add_library(CAF::core SHARED IMPORTED)
    set_target_properties(CAF::core PROPERTIES
      IMPORTED_LOCATION "${CAF_CORE_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${CAF_INCLUDE_DIR}"
      INTERFACE_LINK_LIBRARIES Threads::Threads)
    if(CAF_TROUPE_PATCHED)
      set_property(TARGET CAF::core APPEND PROPERTY
        INTERFACE_COMPILE_DEFINITIONS TROUPE_CAF_PATCHED=1)
    endif()
  endif()
  if(NOT TARGET CAF::io)
    add_library(CAF::io SHARED IMPORTED)
    set_target_properties(CAF::io PROPERTIES
      IMPORTED_LOCATION "${CAF_IO_LIBRARY}" INTERFACE_LINK_LIBRARIES CAF::core)
  endif()
  if(NOT TARGET CAF::openssl)
    add_library(CAF::openssl SHARED IMPORTED)
    set_target_properties(CAF::openssl PROPERTIES
      IMPORTED_LOCATION "${CAF_OPENSSL_LIBRARY}" INTERFACE_LINK_LIBRARIES CAF::io)
  endif()
endif()
