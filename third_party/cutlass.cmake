# Locates the CUTLASS 4.2 headers.
#
# By default they come from the installed nvidia-cutlass wheel (its
# cutlass_library.source_path). -DCUTLASS_DIR=/path/to/cutlass (a checkout
# with include/ and tools/util/include/) overrides that.
set(CUTLASS_DIR "" CACHE PATH "CUTLASS checkout to use instead of the nvidia-cutlass wheel's headers")

if(NOT CUTLASS_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import cutlass_library; print(cutlass_library.source_path)"
    OUTPUT_VARIABLE _cutlass_src OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _cutlass_rc ERROR_QUIET)
  if(_cutlass_rc EQUAL 0 AND EXISTS "${_cutlass_src}/include/cutlass/cutlass.h")
    set(CUTLASS_DIR "${_cutlass_src}")
  endif()
endif()

if(CUTLASS_DIR AND EXISTS "${CUTLASS_DIR}/include/cutlass/cutlass.h")
  set(CUTLASS_FOUND TRUE)
  set(CUTLASS_INCLUDE_DIRS "${CUTLASS_DIR}/include" "${CUTLASS_DIR}/tools/util/include")
  message(STATUS "cutlass_fused: CUTLASS headers from ${CUTLASS_DIR}")
else()
  set(CUTLASS_FOUND FALSE)
  message(STATUS "cutlass_fused: CUTLASS headers not found (pip install nvidia-cutlass==4.2.0.0, or -DCUTLASS_DIR=...)")
endif()
