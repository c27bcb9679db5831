#!/bin/sh
# Compiles and runs the consumer with nothing but `pkg-config --cflags gradclip`, as a Makefile user would.
# Usage: pkg_config_consumer.sh <c++ compiler> <main.cpp> <output executable>
set -eu
flags=$(pkg-config --cflags gradclip)
echo "pkg-config --cflags gradclip: $flags"
# shellcheck disable=SC2086  # the flags are meant to split into words
"$1" -std=c++17 $flags "$2" -o "$3"
"$3"
