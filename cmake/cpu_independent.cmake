# The programs that print documented numbers (examples, the docs' programs) print the same digits on every
# CPU: Eigen's exact vector math instead of its approximate reciprocal square root and fast tanh
# (EIGEN_FAST_MATH, whose rsqrt/rcp instructions round differently on Intel, AMD and emulators), and
# Eigen's default cache sizes instead of the CPU's (EIGEN_NO_CPUID): they set how large matrix products
# are blocked, and so their summation order. gradclip itself uses neither.
function(gradclip_cpu_independent target)
  target_compile_definitions(${target} PRIVATE EIGEN_FAST_MATH=0 EIGEN_NO_CPUID)
endfunction()
