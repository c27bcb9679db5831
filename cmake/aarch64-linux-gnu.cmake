# Cross-compiles for arm64 (aarch64) Linux with Debian's toolchain (g++-aarch64-linux-gnu,
# libc6-dev-arm64-cross) and runs the programs under qemu-user, so CTest and gtest_discover_tests work:
#   cmake --preset arm64   (or -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake)
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu)

# Libraries and programs come from the target's sysroot, or from a prefix given in CMAKE_PREFIX_PATH
# (GoogleTest built for arm64). Header-only Eigen is the host's: its CMake package is arch-independent,
# so packages may also be found on the host; an x86 library found there fails at link time, never silently.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
