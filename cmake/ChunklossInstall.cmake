# install() rules and the exported package: find_package(chunkloss) gives chunkloss::losses.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS chunkloss_core chunkloss_kernels chunkloss_losses
        EXPORT chunklossTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
foreach(dir lib/core kernels losses)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${dir}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endforeach()
install(EXPORT chunklossTargets NAMESPACE chunkloss:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/chunkloss)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/chunklossConfig.cmake.in
  ${PROJECT_BINARY_DIR}/chunklossConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/chunkloss)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/chunklossConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/chunklossConfig.cmake ${PROJECT_BINARY_DIR}/chunklossConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/chunkloss)
