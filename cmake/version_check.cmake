# epx.h carries the version as macros (a C user needs no generated header); they must say
# what VERSION says, or the configuration stops here.
file(STRINGS "${PROJECT_SOURCE_DIR}/include/epx.h" _epx_version_lines
     REGEX "^#define EPX_VERSION_(MAJOR|MINOR|PATCH) +[0-9]+")
set(_epx_header_version "")
foreach(_part MAJOR MINOR PATCH)
  set(_value "?")
  foreach(_line IN LISTS _epx_version_lines)
    if(_line MATCHES "^#define EPX_VERSION_${_part} +([0-9]+)")
      set(_value "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  list(APPEND _epx_header_version "${_value}")
endforeach()
list(JOIN _epx_header_version "." _epx_header_version)
if(NOT _epx_header_version STREQUAL PROJECT_VERSION)
  message(FATAL_ERROR "include/epx.h says version ${_epx_header_version} (EPX_VERSION_MAJOR/MINOR/PATCH) but "
                      "VERSION says ${PROJECT_VERSION}: change both together")
endif()
