# Build options, default build type, warnings and sanitizers shared by every target.
set(CHUNKLOSS_WITH_CUDA AUTO CACHE STRING "Build the CUDA backend: AUTO (if a toolkit is found), ON, OFF")
set_property(CACHE CHUNKLOSS_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
option(CHUNKLOSS_BUILD_TESTS "Build the doctest suites" ON)
option(CHUNKLOSS_BUILD_APPS "Build the apps (bench, train, eval)" ON)
option(CHUNKLOSS_SANITIZE "Build with AddressSanitizer + UndefinedBehaviorSanitizer" OFF)
option(CHUNKLOSS_BUILD_FUZZERS "Build the libFuzzer targets (clang only; instruments every target with ASan + UBSan)" OFF)
set(CHUNKLOSS_CPU_LEVEL AUTO CACHE STRING
    "Instruction set of host code: AUTO (x86-64-v3, i.e. AVX2 and FMA, when the compiler and this machine have it; else the compiler's default), v3, baseline (the compiler's default), native (-march=native; never for binaries that travel)")
set_property(CACHE CHUNKLOSS_CPU_LEVEL PROPERTY STRINGS AUTO v3 baseline native)

if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  set(CMAKE_BUILD_TYPE Release CACHE STRING "Build type" FORCE)
endif()

set(CMAKE_CXX_STANDARD 20)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_CXX_EXTENSIONS OFF)
set(CMAKE_POSITION_INDEPENDENT_CODE ON)

add_library(chunkloss_build_flags INTERFACE)
target_compile_options(chunkloss_build_flags INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow>
  # Error messages name the source file relative to the tree, not the build machine's path.
  $<$<COMPILE_LANGUAGE:CXX>:-fmacro-prefix-map=${PROJECT_SOURCE_DIR}/=>)
# Eigen (the CPU backend's and the model layer's GEMMs) takes its SIMD width from these flags: on
# x86-64 the default build has SSE2 only, and x86-64-v3 runs the CPU paths about twice as fast.
set(chunkloss_cpu_level ${CHUNKLOSS_CPU_LEVEL})
if(chunkloss_cpu_level STREQUAL "AUTO")
  set(chunkloss_cpu_level baseline)
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64)$" AND NOT CMAKE_CROSSCOMPILING)
    try_run(chunkloss_v3_runs chunkloss_v3_builds ${CMAKE_BINARY_DIR}/cpu_level
            ${PROJECT_SOURCE_DIR}/cmake/cpu_has_v3.cpp COMPILE_DEFINITIONS -march=x86-64-v3)
    if(chunkloss_v3_builds AND chunkloss_v3_runs EQUAL 0)
      set(chunkloss_cpu_level v3)
    endif()
  endif()
  message(STATUS "chunkloss: CHUNKLOSS_CPU_LEVEL=AUTO chose ${chunkloss_cpu_level}")
endif()
if(chunkloss_cpu_level STREQUAL "v3")
  target_compile_options(chunkloss_build_flags INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-march=x86-64-v3>)
elseif(chunkloss_cpu_level STREQUAL "native")
  target_compile_options(chunkloss_build_flags INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-march=native>)
elseif(NOT chunkloss_cpu_level STREQUAL "baseline")
  message(FATAL_ERROR "CHUNKLOSS_CPU_LEVEL=${CHUNKLOSS_CPU_LEVEL}: not AUTO, v3, baseline or native")
endif()
if(CHUNKLOSS_SANITIZE)
  target_compile_options(chunkloss_build_flags INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined>)
  target_link_options(chunkloss_build_flags INTERFACE -fsanitize=address,undefined)
endif()
if(CHUNKLOSS_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "CHUNKLOSS_BUILD_FUZZERS=ON needs clang (libFuzzer): configure with "
                        "-DCMAKE_CXX_COMPILER=clang++")
  endif()
  target_compile_options(chunkloss_build_flags INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined>)
  target_link_options(chunkloss_build_flags INTERFACE -fsanitize=address,undefined)
endif()
