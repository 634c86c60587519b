# Installing libepx for C and C++ users: the header, the library with VERSION/SOVERSION, a
# CMake package (find_package(epx CONFIG) gives the target epx::epx) and epx.pc for
# pkg-config. Both package files are relocatable: they find the prefix from where they lie.
#
# Inside a Python wheel (scikit-build-core sets SKBUILD) the library is the package's private
# copy, found by epx/_lib.py as epx/lib/libepx.so: no versioned names (a wheel cannot hold
# symlinks, so each name would be a full copy) and no CMake or pkg-config files.
include(CMakePackageConfigHelpers)

# Before 1.0 a minor release may change the ABI, so the soname carries the minor number.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(EPX_SOVERSION "0.${PROJECT_VERSION_MINOR}")
else()
  set(EPX_SOVERSION "${PROJECT_VERSION_MAJOR}")
endif()

if(SKBUILD)
  install(TARGETS epx LIBRARY DESTINATION lib)
  install(FILES include/epx.h DESTINATION include)
  install(FILES VERSION DESTINATION .) # epx/VERSION: the package's version (epx/_lib.py)
  return()
endif()

set_target_properties(epx PROPERTIES VERSION ${PROJECT_VERSION} SOVERSION ${EPX_SOVERSION} EXPORT_NAME epx)
install(TARGETS epx EXPORT epxTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES include/epx.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
# epx-bench next to it, finding the library it was installed with
set_target_properties(epx-bench PROPERTIES INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}")
install(TARGETS epx-bench RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

set(EPX_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/epx)
install(EXPORT epxTargets NAMESPACE epx:: DESTINATION ${EPX_CMAKE_DIR} FILE epxTargets.cmake)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/epxConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/epxConfig.cmake INSTALL_DESTINATION ${EPX_CMAKE_DIR})
# 0.x: only the same minor release is compatible (see the soname above)
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(_epx_compat SameMinorVersion)
else()
  set(_epx_compat SameMajorVersion)
endif()
write_basic_package_version_file(${PROJECT_BINARY_DIR}/epxConfigVersion.cmake COMPATIBILITY ${_epx_compat})
install(FILES ${PROJECT_BINARY_DIR}/epxConfig.cmake ${PROJECT_BINARY_DIR}/epxConfigVersion.cmake
        DESTINATION ${EPX_CMAKE_DIR})

# epx.pc: the prefix is found from the file's own folder (${pcfiledir}), so the package can
# be installed with `cmake --install --prefix` anywhere.
file(RELATIVE_PATH EPX_PC_TO_PREFIX "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix")
configure_file(${PROJECT_SOURCE_DIR}/cmake/epx.pc.in ${PROJECT_BINARY_DIR}/epx.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/epx.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
