// The library's version, kept equal to the project version in CMakeLists.txt.
#pragma once

#define GRADCLIP_VERSION_MAJOR 0
#define GRADCLIP_VERSION_MINOR 1
#define GRADCLIP_VERSION_PATCH 0
