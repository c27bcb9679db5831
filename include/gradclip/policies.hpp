// Policies: how a norm is accumulated. Empty tag types, passed as the first template argument.
#pragma once

namespace gradclip {

/// Squares and sums in the gradient's own type, as `g.square().sum().sqrt()` does.
/// Reproduces the FP16 overflow bug on purpose; for tests and benchmarks only.
struct naive {};

/// FP16/BF16 promoted to FP32 before squaring (PyTorch's approach): squares and block sums in FP32
/// (FP64 for FP64 input), block totals in FP64; coefficient and scaling in FP32. Overflows once a
/// square or a block sum exceeds FP32's range (e.g. FP32 `[1e20, 1e20]`).
struct promote {};

/// Max scaling: every block of elements is divided by a power of two at least its largest magnitude
/// before squaring, in FP32 (FP64 for FP64 input), and the scaled sums are merged. Never overflows or
/// underflows for finite input; FP32 accumulation limits the accuracy for very long gradients.
struct max_scale {};

/// The default: squares and sums in FP64 with max scaling where FP64's range needs it (only FP64
/// input). Overflow- and underflow-free for every finite input, accurate to about 1e-15 relative.
struct robust {};

}  // namespace gradclip
