// The element types every typed test runs over, with the references and tolerances of reference.hpp.
#pragma once

#include "reference.hpp"

#include <gtest/gtest.h>

#include <Eigen/Core>

namespace gradclip_test {

using element_types = ::testing::Types<Eigen::half, Eigen::bfloat16, float, double>;

}  // namespace gradclip_test
