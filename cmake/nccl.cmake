# EPX_WITH_NCCL: find NCCL for the engine that carries traffic between nodes (docs/nccl-engine.md).
# For now this only finds and records it; nothing is compiled or linked against NCCL yet.
#
# Where it looks, in order: NCCL_ROOT / NCCL_HOME (CMake or environment), the nvidia-nccl-cu13
# wheel of the Python interpreter (Python3_EXECUTABLE, or python3 on PATH), the CUDA toolkit,
# then the system paths. It records
#   EPX_NCCL_INCLUDE_DIR, EPX_NCCL_LIBRARY, EPX_NCCL_VERSION (e.g. 2.30.7),
#   EPX_NCCL_DEVICE_API (nccl_device.h present), EPX_NCCL_MEETS_FLOOR (>= EPX_NCCL_FLOOR).
set(EPX_NCCL_FLOOR "2.30.0" CACHE STRING "Lowest NCCL version the NCCL engine accepts")

set(_epx_nccl_hints)
foreach(_root IN ITEMS "${NCCL_ROOT}" "$ENV{NCCL_ROOT}" "${NCCL_HOME}" "$ENV{NCCL_HOME}")
  if(_root)
    list(APPEND _epx_nccl_hints "${_root}")
  endif()
endforeach()

# The wheel: site-packages/nvidia/nccl/{include,lib}
set(_epx_py "${Python3_EXECUTABLE}")
if(NOT _epx_py)
  find_program(_epx_py NAMES python3 python)
endif()
if(_epx_py)
  execute_process(
    COMMAND "${_epx_py}" -c "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])"
    OUTPUT_VARIABLE _epx_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _epx_wheel_rc)
  if(_epx_wheel_rc EQUAL 0 AND _epx_wheel)
    list(APPEND _epx_nccl_hints "${_epx_wheel}")
  endif()
endif()
if(CUDAToolkit_INCLUDE_DIRS)
  foreach(_inc IN LISTS CUDAToolkit_INCLUDE_DIRS)
    get_filename_component(_root "${_inc}" DIRECTORY)
    list(APPEND _epx_nccl_hints "${_root}")
  endforeach()
endif()

find_path(EPX_NCCL_INCLUDE_DIR nccl.h HINTS ${_epx_nccl_hints} PATH_SUFFIXES include)
# the library next to the header first, so that the two are one release
if(EPX_NCCL_INCLUDE_DIR)
  get_filename_component(_epx_nccl_root "${EPX_NCCL_INCLUDE_DIR}" DIRECTORY)
  find_library(EPX_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR PATHS "${_epx_nccl_root}"
               PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
endif()
find_library(EPX_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_epx_nccl_hints} PATH_SUFFIXES lib lib64)

if(NOT EPX_NCCL_INCLUDE_DIR OR NOT EPX_NCCL_LIBRARY)
  message(FATAL_ERROR "epx: EPX_WITH_NCCL is ON but NCCL was not found (nccl.h: ${EPX_NCCL_INCLUDE_DIR}, "
                      "libnccl: ${EPX_NCCL_LIBRARY}). Set NCCL_ROOT, or pip install nvidia-nccl-cu13.")
endif()

file(STRINGS "${EPX_NCCL_INCLUDE_DIR}/nccl.h" _epx_nccl_defs REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
set(EPX_NCCL_VERSION "")
foreach(_part IN ITEMS MAJOR MINOR PATCH)
  string(REGEX MATCH "NCCL_${_part} ([0-9]+)" _m "${_epx_nccl_defs}")
  list(APPEND EPX_NCCL_VERSION "${CMAKE_MATCH_1}")
endforeach()
list(JOIN EPX_NCCL_VERSION "." EPX_NCCL_VERSION)

if(EXISTS "${EPX_NCCL_INCLUDE_DIR}/nccl_device.h")
  set(EPX_NCCL_DEVICE_API ON)
else()
  set(EPX_NCCL_DEVICE_API OFF)
endif()
if(EPX_NCCL_VERSION VERSION_GREATER_EQUAL EPX_NCCL_FLOOR)
  set(EPX_NCCL_MEETS_FLOOR ON)
else()
  set(EPX_NCCL_MEETS_FLOOR OFF)
  message(WARNING "epx: NCCL ${EPX_NCCL_VERSION} in ${EPX_NCCL_INCLUDE_DIR} is below the NCCL engine's floor "
                  "${EPX_NCCL_FLOOR} (ncclCommQueryProperties and the versioned device-communicator requirements)")
endif()
message(STATUS "epx: NCCL ${EPX_NCCL_VERSION} (device API ${EPX_NCCL_DEVICE_API}, floor ${EPX_NCCL_FLOOR} met: "
               "${EPX_NCCL_MEETS_FLOOR}): ${EPX_NCCL_INCLUDE_DIR}, ${EPX_NCCL_LIBRARY}; recorded only, not linked")
