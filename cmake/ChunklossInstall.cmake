# install() rules and the exported package: find_package(chunkloss) gives chunkloss::losses.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(chunkloss_installed chunkloss_core chunkloss_dist chunkloss_kernels chunkloss_losses)
# Public headers: the kernels' are internal, and the NCCL communicator needs the CUDA build.
set(chunkloss_include_dirs lib/core lib/dist losses)
if(CHUNKLOSS_HAVE_CUDA)
  list(APPEND chunkloss_installed chunkloss_gpu chunkloss_cuda_kernels chunkloss_gpu_internal)
  list(APPEND chunkloss_include_dirs lib/gpu)
endif()
install(TARGETS ${chunkloss_installed}
        EXPORT chunklossTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
set(chunkloss_excluded_headers "")
if(NOT CHUNKLOSS_HAVE_CUDA)
  set(chunkloss_excluded_headers PATTERN nccl.h EXCLUDE)
endif()
foreach(dir ${chunkloss_include_dirs})
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${dir}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
          ${chunkloss_excluded_headers})
endforeach()
install(EXPORT chunklossTargets NAMESPACE chunkloss:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/chunkloss)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/chunklossConfig.cmake.in
  ${PROJECT_BINARY_DIR}/chunklossConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/chunkloss)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/chunklossConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/chunklossConfig.cmake ${PROJECT_BINARY_DIR}/chunklossConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/chunkloss)
