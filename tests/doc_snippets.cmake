# The C++ in README.md and docs/*.md, extracted by scripts/doc_snippets.py (conventions: its docstring
# and docs/development.md): fragments compile in one translation unit (target docs_snippets); programs
# build and run as tests docs_program_*, which compare what they print with the output block shown under
# them; output blocks tagged output=TARGET are compared with that example's output (tests docs_output_*).
# Extraction runs at configure time and again whenever a markdown file changes.
find_program(GRADCLIP_PYTHON3 NAMES python3)
if(NOT GRADCLIP_PYTHON3)
  message(WARNING "python3 not found: the code in README.md and docs/*.md is not compiled")
  return()
endif()
file(GLOB doc_markdown CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/docs/*.md)
list(PREPEND doc_markdown ${PROJECT_SOURCE_DIR}/README.md)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${doc_markdown}
                                                               ${PROJECT_SOURCE_DIR}/scripts/doc_snippets.py)
set(doc_dir ${CMAKE_CURRENT_BINARY_DIR}/doc_snippets)
execute_process(COMMAND ${GRADCLIP_PYTHON3} ${PROJECT_SOURCE_DIR}/scripts/doc_snippets.py extract --root
                        ${PROJECT_SOURCE_DIR} --out ${doc_dir} ${doc_markdown} RESULT_VARIABLE doc_result
                        ERROR_VARIABLE doc_error)
if(NOT doc_result EQUAL 0)
  message(FATAL_ERROR "scripts/doc_snippets.py: ${doc_error}")
endif()
include(${doc_dir}/snippets.cmake)
include(${PROJECT_SOURCE_DIR}/cmake/cpu_independent.cmake)

# Fragments are compiled, not linked: the prelude only declares what they use. Strict warnings, except
# those a fragment cannot avoid (it shadows the prelude's names, and shows results it does not use).
set(doc_fragment_warnings -Wno-shadow -Wno-unused-variable -Wno-unused-but-set-variable)
function(gradclip_doc_fragments name)
  add_library(${name} OBJECT ${ARGN})
  target_link_libraries(${name} PRIVATE gradclip::gradclip)
  target_include_directories(${name} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
  gradclip_unit_test(${name})  # compiled only, so at the unit tests' options
  gradclip_cpu_independent(${name})
  target_compile_options(${name} PRIVATE ${doc_fragment_warnings})
endfunction()
add_custom_target(docs_snippets ALL)
if(doc_fragments)
  gradclip_doc_fragments(docs_fragments ${doc_fragments})
  add_dependencies(docs_snippets docs_fragments)
endif()
if(doc_fragments_mpi AND MPI_CXX_FOUND)
  gradclip_doc_fragments(docs_fragments_mpi ${doc_fragments_mpi})
  target_link_libraries(docs_fragments_mpi PRIVATE MPI::MPI_CXX)
  add_dependencies(docs_snippets docs_fragments_mpi)
endif()
if(doc_fragments_torch AND GRADCLIP_WITH_TORCH)
  gradclip_doc_fragments(docs_fragments_torch ${doc_fragments_torch})
  target_link_libraries(docs_fragments_torch PRIVATE ${TORCH_LIBRARIES})
  add_dependencies(docs_snippets docs_fragments_torch)
endif()

# Programs: built everywhere their tag's dependency is found; run (and their output compared) where they
# need no MPI or libtorch, and not when cross-compiling (arm64 contracts a * b + c into fused
# multiply-adds in Eigen's products, so it need not print the digits measured on x86-64). Every run goes
# through doc_snippets.py check, so that GRADCLIP_EMULATOR (scripts/qemu_x86_64.sh) runs them all under
# another x86-64 CPU model.
set(doc_check ${GRADCLIP_PYTHON3} ${PROJECT_SOURCE_DIR}/scripts/doc_snippets.py check)
foreach(name IN LISTS doc_programs)
  set(tag ${doc_program_${name}_tag})
  if((tag STREQUAL "mpi" AND NOT MPI_CXX_FOUND) OR (tag STREQUAL "torch" AND NOT GRADCLIP_WITH_TORCH))
    continue()
  endif()
  add_executable(docs_program_${name} ${doc_dir}/${name}.cpp)
  target_link_libraries(docs_program_${name} PRIVATE gradclip::gradclip)
  gradclip_strict_warnings(docs_program_${name})
  gradclip_cpu_independent(docs_program_${name})
  add_dependencies(docs_snippets docs_program_${name})
  if(tag STREQUAL "mpi")
    target_link_libraries(docs_program_${name} PRIVATE MPI::MPI_CXX)
  elseif(tag STREQUAL "torch")
    target_link_libraries(docs_program_${name} PRIVATE ${TORCH_LIBRARIES})
  elseif(NOT CMAKE_CROSSCOMPILING)
    set(expected)
    if(doc_program_${name}_expected)
      set(expected --expected ${doc_program_${name}_expected})
    endif()
    add_test(NAME docs_program_${name} COMMAND ${doc_check} ${expected} -- $<TARGET_FILE:docs_program_${name}>)
  endif()
endforeach()

# Outputs of the examples (their targets are defined in examples/, so they are named by generator
# expressions, which see every directory's targets).
if(GRADCLIP_BUILD_EXAMPLES AND NOT CMAKE_CROSSCOMPILING)
  foreach(name IN LISTS doc_outputs)
    set(target ${doc_output_${name}_target})
    if((target STREQUAL "mpi_data_parallel" AND NOT MPI_CXX_FOUND)
       OR (target STREQUAL "libtorch_training" AND NOT GRADCLIP_WITH_TORCH))
      continue()
    endif()
    set(excerpt)
    if(doc_output_${name}_excerpt)
      set(excerpt --excerpt)
    endif()
    set(command $<TARGET_FILE:${target}> ${doc_output_${name}_args})
    set(launcher)
    if(doc_output_${name}_ranks)
      if(NOT MPI_CXX_FOUND)
        continue()
      endif()
      set(launcher ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${doc_output_${name}_ranks} ${gradclip_mpiexec_flags}
                   ${MPIEXEC_PREFLAGS})
      set(command ${launcher} ${command} ${MPIEXEC_POSTFLAGS})
    endif()
    list(LENGTH launcher launcher_words)
    # Each in a directory of its own: examples write files (logs) into the working directory.
    file(MAKE_DIRECTORY ${doc_dir}/run_${name})
    add_test(NAME docs_output_${name}
             COMMAND ${doc_check} --expected ${doc_output_${name}_expected} ${excerpt} --launcher ${launcher_words} --
                     ${command} WORKING_DIRECTORY ${doc_dir}/run_${name})
    if(doc_output_${name}_ranks)
      set_tests_properties(docs_output_${name} PROPERTIES ENVIRONMENT "${gradclip_mpiexec_environment}" PROCESSORS
                                                          ${doc_output_${name}_ranks} TIMEOUT 300)
    endif()
  endforeach()
endif()
