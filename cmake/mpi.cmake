# MPI for gradclip's own tests and examples (the library itself never needs it): find it, and run programs
# under mpiexec in CTest. Included by each directory that needs it, since find_package results and imported
# targets are scoped to the directory.
find_package(MPI COMPONENTS CXX)

# OpenMPI refuses more ranks than cores without --oversubscribe, and root without two confirmations
# (CI runs as root on two cores); other MPIs take neither, so ask mpiexec which one it is.
set(gradclip_mpiexec_flags)
set(gradclip_mpiexec_environment)
if(MPI_CXX_FOUND)
  execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE version_text ERROR_QUIET)
  if(version_text MATCHES "Open MPI|OpenRTE")
    set(gradclip_mpiexec_flags --oversubscribe)
    # OpenMPI keeps what MPI_Init allocates (much of it in plugins it loads) past MPI_Finalize, which
    # LeakSanitizer would report as leaks in every sanitized MPI program: leave leak checks to the rest.
    set(gradclip_mpiexec_environment OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
                                     ASAN_OPTIONS=detect_leaks=0)
  endif()
endif()

# Registers CTest test `name` running `target` (and ARGN) on `ranks` processes under mpiexec.
function(gradclip_add_mpi_test name target ranks)
  add_test(NAME ${name} COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${gradclip_mpiexec_flags}
                                ${MPIEXEC_PREFLAGS} $<TARGET_FILE:${target}> ${MPIEXEC_POSTFLAGS} ${ARGN})
  # A rank that fails without throwing could leave the others waiting: bound the run.
  set_tests_properties(${name} PROPERTIES ENVIRONMENT "${gradclip_mpiexec_environment}" PROCESSORS ${ranks}
                                          TIMEOUT 300)
endfunction()
