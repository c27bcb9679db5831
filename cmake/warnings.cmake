# Strict warnings for gradclip's own tests, examples and benchmarks; never on the interface target.
function(gradclip_strict_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow -Werror)
  if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    # GoogleTest's TYPED_TEST_SUITE(Name, Types) leaves its variadic argument empty.
    target_compile_options(${target} PRIVATE -Wno-gnu-zero-variadic-macro-arguments)
  endif()
endfunction()
