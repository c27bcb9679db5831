// The library's version, stated here only: CMakeLists.txt reads these three lines (keep their form).
#pragma once

#define GRADCLIP_VERSION_MAJOR 0
#define GRADCLIP_VERSION_MINOR 1
#define GRADCLIP_VERSION_PATCH 0
