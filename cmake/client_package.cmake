# Installs the client for programs outside this tree (component "client"):
#   lib/libulysses_client.so*         the C ABI and the C++ API
#   include/ulysses/c_api.h           the C ABI
#   include/ulysses/client/client.h   the C++ API, with the common headers it includes
#   lib/cmake/ulysses/                find_package(ulysses): ulysses::client (C ABI, no other
#                                     dependency) and ulysses::client_cpp (C++ API, adds absl)
#   lib/pkgconfig/ulysses.pc          the C ABI; ulysses-cpp.pc the C++ API
# The tree is relocatable: the CMake package and the .pc files locate the prefix from where
# they lie.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(ulysses_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/ulysses)

install(TARGETS ulysses_client_shared EXPORT ulyssesTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT client NAMELINK_COMPONENT client)
install(FILES ${PROJECT_SOURCE_DIR}/client/include/ulysses/c_api.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ulysses COMPONENT client)
install(FILES ${PROJECT_SOURCE_DIR}/client/include/ulysses/client/client.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ulysses/client COMPONENT client)
install(FILES
  ${PROJECT_SOURCE_DIR}/common/include/ulysses/common/geometry.h
  ${PROJECT_SOURCE_DIR}/common/include/ulysses/common/fused.h
  ${PROJECT_SOURCE_DIR}/common/include/ulysses/common/status.h
  ${PROJECT_SOURCE_DIR}/common/include/ulysses/common/strings.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ulysses/common COMPONENT client)
install(EXPORT ulyssesTargets NAMESPACE ulysses:: DESTINATION ${ulysses_cmake_dir}
  COMPONENT client)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/ulyssesConfig.cmake.in
  ${PROJECT_BINARY_DIR}/cmake/ulyssesConfig.cmake INSTALL_DESTINATION ${ulysses_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/cmake/ulyssesConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/cmake/ulyssesConfig.cmake
  ${PROJECT_BINARY_DIR}/cmake/ulyssesConfigVersion.cmake
  DESTINATION ${ulysses_cmake_dir} COMPONENT client)

# pkg-config: the prefix relative to lib*/pkgconfig, so that the tree can move.
file(RELATIVE_PATH ulysses_pc_prefix /_/${CMAKE_INSTALL_LIBDIR}/pkgconfig /_)
set(ULYSSES_PC_PREFIX "\${pcfiledir}/${ulysses_pc_prefix}")
foreach(pc ulysses ulysses-cpp)
  configure_file(${PROJECT_SOURCE_DIR}/cmake/${pc}.pc.in ${PROJECT_BINARY_DIR}/pkgconfig/${pc}.pc @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/pkgconfig/${pc}.pc
    DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT client)
endforeach()
