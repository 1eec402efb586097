# Helpers that make every component, test, tool and benchmark the same shape.

option(ACCEL_WERROR "Treat warnings as errors" ON)
set(ACCEL_WARNINGS -Wall -Wextra)
if(ACCEL_WERROR)
  list(APPEND ACCEL_WARNINGS -Werror)
endif()
list(APPEND ACCEL_WARNINGS -Wno-unused-parameter)

# An imported target NAME for library LIB whose header HEADER is found by a
# plain search (CMAKE_PREFIX_PATH), for machines without pkg-config.
function(accel_import_library name lib header)
  string(MAKE_C_IDENTIFIER "${name}" id)
  find_path(${id}_INCLUDE_DIR ${header} REQUIRED)
  find_library(${id}_LIBRARY ${lib} REQUIRED)
  add_library(${name} UNKNOWN IMPORTED)
  set_target_properties(${name} PROPERTIES IMPORTED_LOCATION ${${id}_LIBRARY}
    INTERFACE_INCLUDE_DIRECTORIES ${${id}_INCLUDE_DIR})
endfunction()

# Sets ACCEL_TORCH_VERSION and ACCEL_TORCH_HAS_CUDA from the libtorch found.
function(accel_detect_torch)
  set(version "${Torch_VERSION}")
  if(NOT version)
    set(version "unknown")
  endif()
  set(has_cuda OFF)
  if(TARGET torch_cuda OR CAFFE2_USE_CUDA OR TORCH_CUDA_LIBRARIES)
    set(has_cuda ON)
  endif()
  set(ACCEL_TORCH_VERSION ${version} PARENT_SCOPE)
  set(ACCEL_TORCH_HAS_CUDA ${has_cuda} PARENT_SCOPE)
endfunction()

# The libtorch headers most of our .cc files need, precompiled once in one
# target and reused by every target that says TORCH (see accel_use_torch).
function(accel_torch_pch_target)
  if(TARGET accel_torch_pch OR NOT ACCEL_USE_PCH)
    return()
  endif()
  add_library(accel_torch_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch_stub.cc)
  target_link_libraries(accel_torch_pch PUBLIC torch)
  # -pthread (it defines _REENTRANT) everywhere the PCH is used: gRPC's
  # targets add it, and a PCH built without it is rejected beside them.
  target_compile_options(accel_torch_pch PRIVATE ${ACCEL_WARNINGS} -pthread)
  target_precompile_headers(accel_torch_pch PRIVATE
    <ATen/core/Tensor.h> <ATen/Functions.h> <ATen/TensorOperators.h>)
endfunction()

function(accel_use_torch target)
  # stdc++ ahead of torch. PyTorch's wheels export std::filesystem functions
  # from libtorch.so (pytorch/pytorch#133437); a binary that meets libtorch
  # first on its link line binds our std::filesystem calls to those copies,
  # which crash (torch 2.11 on the GPU machine: remove_all jumped to address
  # 0). With libstdc++ named first the calls bind to libstdc++'s own.
  target_link_libraries(${target} PRIVATE stdc++ torch)
  target_compile_options(${target} PRIVATE -pthread)
  if(ACCEL_USE_PCH)
    accel_torch_pch_target()
    target_precompile_headers(${target} REUSE_FROM accel_torch_pch)
  endif()
endfunction()

# accel_torch_parallel(target source...): these sources call at::parallel_for.
# In libtorch 1.13 (OpenMP backend) it is a header template around
# `#pragma omp parallel`, so it runs on one thread in a file compiled without
# -fopenmp. They get -fopenmp and skip the shared PCH, which is built without
# it. Only where that links the OpenMP runtime libtorch already uses: g++'s
# libgomp against Debian's libtorch. clang's libomp, or the renamed libgomp
# that PyTorch's wheels ship in torch/lib, would be a second runtime with its
# own threads; there these files stay serial.
function(accel_torch_parallel target)
  file(GLOB bundled_runtime "${TORCH_INSTALL_PREFIX}/lib/libgomp*")
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU" OR bundled_runtime)
    return()
  endif()
  find_package(OpenMP COMPONENTS CXX)
  if(NOT OpenMP_CXX_FOUND)
    return()
  endif()
  set_source_files_properties(${ARGN} TARGET_DIRECTORY ${target} PROPERTIES
    COMPILE_OPTIONS "${OpenMP_CXX_FLAGS}" SKIP_PRECOMPILE_HEADERS ON)
  # The library alone: OpenMP::OpenMP_CXX would put -fopenmp on every source.
  target_link_libraries(${target} PRIVATE ${OpenMP_CXX_LIBRARIES})
endfunction()

# accel_component(NAME name [SOURCES ...] [PUBLIC_DEPS ...] [PRIVATE_DEPS ...] [TORCH])
# Makes accel_<name> (alias accel::<name>). Headers are included from the repo
# root as "<name>/<header>.h". A component without sources is an INTERFACE
# target: its place in the dependency graph exists before its code does.
function(accel_component)
  cmake_parse_arguments(C "TORCH" "NAME" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  set(target accel_${C_NAME})
  if(C_SOURCES)
    add_library(${target} STATIC ${C_SOURCES})
    target_include_directories(${target} PUBLIC ${PROJECT_SOURCE_DIR})
    target_compile_options(${target} PRIVATE ${ACCEL_WARNINGS})
    target_link_libraries(${target} PUBLIC ${C_PUBLIC_DEPS} PRIVATE ${C_PRIVATE_DEPS})
    if(C_TORCH)
      accel_use_torch(${target})
      # Public headers may include <ATen/core/Tensor.h>; consumers need its include path.
      target_link_libraries(${target} PUBLIC torch)
    endif()
  else()
    add_library(${target} INTERFACE)
    target_include_directories(${target} INTERFACE ${PROJECT_SOURCE_DIR})
    target_link_libraries(${target} INTERFACE ${C_PUBLIC_DEPS})
  endif()
  add_library(accel::${C_NAME} ALIAS ${target})
endfunction()

# accel_binary(NAME name SOURCES ... DEPS ... [TORCH])  -> build/bin/<name>
function(accel_binary)
  cmake_parse_arguments(B "TORCH" "NAME" "SOURCES;DEPS" ${ARGN})
  add_executable(${B_NAME} ${B_SOURCES})
  target_compile_options(${B_NAME} PRIVATE ${ACCEL_WARNINGS})
  target_link_libraries(${B_NAME} PRIVATE ${B_DEPS})
  if(B_TORCH)
    accel_use_torch(${B_NAME})
  endif()
endfunction()

# accel_test(<component>/<file>_test DEPS ... [TORCH] [LABELS ...])
# tests/<component>/<file>_test.cc -> executable <component>_<file>_test; each
# TEST is its own ctest entry.
function(accel_test path)
  cmake_parse_arguments(T "TORCH" "" "DEPS;LABELS" ${ARGN})
  string(REPLACE "/" "_" name ${path})
  add_executable(${name} ${CMAKE_CURRENT_SOURCE_DIR}/${path}.cc)
  target_compile_options(${name} PRIVATE ${ACCEL_WARNINGS})
  target_link_libraries(${name} PRIVATE ${T_DEPS} accel_testing GTest::gmock GTest::gtest_main)
  if(T_TORCH)
    accel_use_torch(${name})
  endif()
  get_filename_component(component ${path} DIRECTORY)
  set_property(GLOBAL APPEND PROPERTY ACCEL_TESTS_${component} ${name})
  # LABELS sanitized: also built and run by the ASan + UBSan job.
  if("sanitized" IN_LIST T_LABELS)
    set_property(GLOBAL APPEND PROPERTY ACCEL_TESTS_sanitized ${name})
  endif()
  # One label and one environment entry: PRE_TEST discovery writes a list
  # property as separate arguments, so a second element would be read as a
  # property name. "models_sanitized" still matches -L models.
  set(label ${component})
  if("sanitized" IN_LIST T_LABELS)
    set(label ${component}_sanitized)
  endif()
  # Listing the tests starts the binary: under ASan, a libtorch-linked binary on a busy 2-core
  # machine can take longer than the default 5 s to start, which fails the whole ctest run.
  gtest_discover_tests(${name}
    DISCOVERY_MODE PRE_TEST DISCOVERY_TIMEOUT 120
    PROPERTIES LABELS ${label} ENVIRONMENT "ACCEL_BIN_DIR=${CMAKE_BINARY_DIR}/bin")
endfunction()
