# Builds the Debian package from a lean configuration of the source tree and checks what is in it.
# COMPILED=ON packages the compiled library (GRADCLIP_COMPILED_LIBRARY) for ARCH, dpkg's name for this
# machine; otherwise the headers, for every architecture.
# Usage: cmake -DSOURCE_DIR=... -DWORK_DIR=... -DVERSION=... [-DCOMPILED=ON -DARCH=amd64] -P deb_package.cmake
if(NOT COMPILED)
  set(COMPILED OFF)
  set(ARCH all)
endif()
set(build ${WORK_DIR}/build)
set(deb ${WORK_DIR}/libgradclip-dev_${VERSION}_${ARCH}.deb)
file(REMOVE_RECURSE ${WORK_DIR})

execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${build} -DCMAKE_BUILD_TYPE=Release
                        -DGRADCLIP_BUILD_TESTS=OFF -DGRADCLIP_BUILD_EXAMPLES=OFF -DGRADCLIP_BUILD_BENCHMARKS=OFF
                        -DGRADCLIP_COMPILED_LIBRARY=${COMPILED} COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${CMAKE_COMMAND} --build ${build} COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${CMAKE_CPACK_COMMAND} -G DEB -B ${WORK_DIR} WORKING_DIRECTORY ${build}
                COMMAND_ERROR_IS_FATAL ANY)
if(NOT EXISTS ${deb})
  message(FATAL_ERROR "cpack did not produce ${deb}")
endif()

find_program(DPKG_DEB dpkg-deb)
if(NOT DPKG_DEB)
  message(STATUS "dpkg-deb not found: ${deb} built, its contents not checked")
  return()
endif()
foreach(field_and_value "Package=libgradclip-dev" "Version=${VERSION}" "Architecture=${ARCH}"
                        "Depends=libeigen3-dev (>= 3.4)")
  string(FIND "${field_and_value}" "=" equals)
  string(SUBSTRING "${field_and_value}" 0 ${equals} field)
  math(EXPR value_start "${equals} + 1")
  string(SUBSTRING "${field_and_value}" ${value_start} -1 expected)
  execute_process(COMMAND ${DPKG_DEB} --field ${deb} ${field} OUTPUT_VARIABLE actual
                  OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
  if(NOT actual STREQUAL expected)
    message(FATAL_ERROR "${field} is '${actual}', expected '${expected}'")
  endif()
endforeach()
execute_process(COMMAND ${DPKG_DEB} --contents ${deb} OUTPUT_VARIABLE contents COMMAND_ERROR_IS_FATAL ANY)
set(paths usr/include/gradclip/gradclip.hpp usr/share/cmake/gradclip/gradclipConfig.cmake
          usr/share/cmake/gradclip/gradclipConfigVersion.cmake usr/share/pkgconfig/gradclip.pc
          usr/share/doc/libgradclip-dev/copyright)
if(COMPILED)
  list(APPEND paths usr/lib/libgradclip.a)
endif()
foreach(path IN LISTS paths)
  string(FIND "${contents}" "./${path}" found)
  if(found EQUAL -1)
    message(FATAL_ERROR "${deb} lacks /${path}:\n${contents}")
  endif()
endforeach()
message(STATUS "${deb}: libgradclip-dev ${VERSION}, ${ARCH}, depends on libeigen3-dev")
