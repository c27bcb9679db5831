// What every code fragment of README.md and docs/*.md may use without declaring it (scripts/doc_snippets.py
// compiles each fragment as a function body after this header). Declarations only: fragments are compiled,
// never linked or run.
#pragma once

#include <gradclip/gradclip.hpp>

#include <unsupported/Eigen/CXX11/Tensor>

#include <cstddef>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace doc {

/// The optimizer of the training loop: step() with or without the gradients.
struct optimizer_t {
  template <class... Args>
  void step(Args&&...);
};

}  // namespace doc

// A group of FP16 gradients (any range of gradients would do), and the parts of a model.
extern std::vector<Eigen::Tensor<Eigen::half, 2>> grads;
extern Eigen::Tensor<Eigen::half, 2> grad;
extern Eigen::Tensor<Eigen::half, 2> weights;
extern Eigen::VectorXf bias;
extern std::vector<Eigen::VectorXf> my_shards;  // this rank's shards of a sharded model
extern doc::optimizer_t optimizer;
extern std::stringstream checkpoint;
extern double loss;
extern int steps;
void backward(double scaled_loss);  // the backward pass of the loss, scaled
