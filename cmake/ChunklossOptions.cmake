# Build options, default build type, warnings and sanitizers shared by every target.
set(CHUNKLOSS_WITH_CUDA AUTO CACHE STRING "Build the CUDA backend: AUTO (if a toolkit is found), ON, OFF")
set_property(CACHE CHUNKLOSS_WITH_CUDA PROPERTY STRINGS AUTO ON OFF)
option(CHUNKLOSS_BUILD_TESTS "Build the doctest suites" ON)
option(CHUNKLOSS_BUILD_APPS "Build the apps (bench, train, eval)" ON)
option(CHUNKLOSS_SANITIZE "Build with AddressSanitizer + UndefinedBehaviorSanitizer" OFF)
option(CHUNKLOSS_BUILD_FUZZERS "Build the libFuzzer targets (clang only; instruments every target with ASan + UBSan)" OFF)
option(CHUNKLOSS_NATIVE "Tune host code for this CPU (-march=native); never for binaries that travel" OFF)

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
if(CHUNKLOSS_NATIVE)
  target_compile_options(chunkloss_build_flags INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-march=native>)
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
