// The torch op around a matmul whose weight is packed in uint8 chunks of `tile` output rows by `block` input columns
// (int4.cpp, q4k.cpp, q6k.cpp): x's checks (the ones the kernel relies on, so a bad call raises instead of reading out
// of bounds), contiguity, the output and the call in bfloat16 or float32. Included after torch's stable headers.
#pragma once

#include <stdexcept>
#include <string>

// `matmul(x, M, K, w, N, out, threads, portable)` for x and out both uint16_t (bfloat16) or both float; nonzero when
// its scratch memory cannot be had.
template <typename Matmul>
static torch::stable::Tensor chunked_matmul_op(const char* name, torch::stable::Tensor x, torch::stable::Tensor packed,
                                               int64_t out_features, bool portable, int64_t tile, int64_t block,
                                               int64_t chunk, Matmul matmul) {
    using torch::headeronly::ScalarType;
    const bool bf16 = x.scalar_type() == ScalarType::BFloat16;
    if (!bf16 && x.scalar_type() != ScalarType::Float)
        throw std::invalid_argument(std::string(name) + ": x must be bfloat16 or float32");
    if (packed.scalar_type() != ScalarType::Byte || packed.dim() != 3 || x.dim() != 2 || out_features % tile ||
        packed.size(0) != out_features / tile || packed.size(1) * block != x.size(1) || packed.size(2) != chunk)
        throw std::invalid_argument(std::string(name) + ": x (M, K) and packed uint8 chunks (N / " +
                                    std::to_string(tile) + ", K / " + std::to_string(block) + ", " +
                                    std::to_string(chunk) + ") for N = out_features, K a multiple of " +
                                    std::to_string(block) + ", N of " + std::to_string(tile));
    if (!x.is_contiguous()) x = torch::stable::contiguous(x);
    if (!packed.is_contiguous()) packed = torch::stable::contiguous(packed);
    const int64_t M = x.size(0), K = x.size(1), N = out_features;
    torch::stable::Tensor out = torch::stable::new_empty(x, {M, N});
    const int threads = int(torch::stable::get_num_threads());
    const uint8_t* w = static_cast<const uint8_t*>(packed.data_ptr());
    const int status = bf16 ? matmul(static_cast<const uint16_t*>(x.data_ptr()), M, K, w, N,
                                     static_cast<uint16_t*>(out.data_ptr()), threads, portable)
                            : matmul(static_cast<const float*>(x.data_ptr()), M, K, w, N,
                                     static_cast<float*>(out.data_ptr()), threads, portable);
    if (status) throw std::runtime_error(std::string(name) + ": no memory for the quantized activations");
    return out;
}
