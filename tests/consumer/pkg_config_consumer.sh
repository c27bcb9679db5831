#!/bin/sh
# Compiles and runs the consumer with nothing but `pkg-config --cflags --libs gradclip`, as a Makefile user
# would. GRADCLIP_CONSUMER_FLAGS: more compiler flags (the build's, whose sanitizers an installed compiled
# library has); GRADCLIP_CONSUMER_EXPECT_COMPILED=ON: the .pc file must select the compiled library.
# Usage: pkg_config_consumer.sh <c++ compiler> <main.cpp> <output executable>
set -eu
flags=$(pkg-config --cflags gradclip)
libs=$(pkg-config --libs gradclip)
echo "pkg-config --cflags gradclip: $flags"
echo "pkg-config --libs gradclip: $libs"
extra=${GRADCLIP_CONSUMER_FLAGS:-}
case ${GRADCLIP_CONSUMER_EXPECT_COMPILED:-OFF} in
  ON | on | 1 | TRUE | true) extra="$extra -DGRADCLIP_CONSUMER_EXPECT_COMPILED" ;;
esac
# shellcheck disable=SC2086  # the flags are meant to split into words
"$1" -std=c++17 $extra $flags "$2" $libs -o "$3"
"$3"
