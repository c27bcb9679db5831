# cmake -DPROGRAM=... -DEMULATOR=qemu-x86_64 -DCPU=Haswell -P compare.cmake: runs PROGRAM natively and
# under the emulator's CPU model, and fails unless both exit with 0 and print the same.
foreach(run native emulated)
  if(run STREQUAL "native")
    set(command ${PROGRAM})
  else()
    separate_arguments(command UNIX_COMMAND "${EMULATOR}")
    list(APPEND command -cpu ${CPU} ${PROGRAM})
  endif()
  execute_process(COMMAND ${command} RESULT_VARIABLE ${run}_result OUTPUT_VARIABLE ${run}_output
                  ERROR_VARIABLE ${run}_error)
  if(NOT ${run}_result EQUAL 0)
    message(FATAL_ERROR "${command} failed (${${run}_result}):\n${${run}_output}${${run}_error}")
  endif()
endforeach()
if(NOT native_output STREQUAL emulated_output)
  message(FATAL_ERROR "Under ${EMULATOR} -cpu ${CPU} the program prints\n${emulated_output}\nnatively\n${native_output}")
endif()
message(STATUS "The same under -cpu ${CPU} as natively:\n${native_output}")
