// An int8 KV cache's writes and reads, one pass each (see kv_int8.py). Built by tformer.inference.native.load
// (-O3 -march=native -fopenmp) against torch's stable C ABI, which registers the ops at the end. Each vector of
// head_dim keys or values of one token and KV head is rounded as kv_int8.quantize_int8 rounds it: the same
// divisions, roundings and products, so the same bits. The loops are plain ones the compiler vectorizes.
#pragma GCC optimize("fp-contract=off")  // every product rounds on its own, as in torch's eager ops
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "native.h"

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Work below this many values runs on the calling thread: a fork and join costs more than it saves.
constexpr int64_t PARALLEL_VALUES = int64_t(1) << 15;
constexpr float LEVELS = 127.f;        // numbers are round(x / scale) in [-127, 127], scale = max |x| / 127
constexpr float ROUNDER = 12582912.f;  // 1.5 * 2^23: q + ROUNDER - ROUNDER rounds |q| <= 2^22 to nearest even

// One vector x of `dim` values: its int8 numbers and scale, and what they read back as (`rounded`, in T). As torch's
// formula: s = max |x| / 127, numbers = round(x / max(s, FLT_MIN)) clamped to +-127. A vector holding a NaN gets a
// NaN scale and one holding an infinity an infinite one (torch's amax), with numbers 0: it reads back as NaN.
template <typename T>
static inline void round_vector(const T* __restrict x, int64_t dim, int8_t* __restrict numbers, float* scale,
                                T* __restrict rounded) {
    float top = 0.f;
    int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
    for (int64_t k = 0; k < dim; ++k) {
        const float v = std::fabs(to_float(x[k]));
        nan |= v != v;
        top = std::max(top, v);  // a NaN leaves top as it was: `nan` tells
    }
    const float s = nan ? NAN : top / LEVELS, divisor = s > FLT_MIN ? s : FLT_MIN;
    *scale = s;
    if (nan || !(top <= FLT_MAX)) {
        for (int64_t k = 0; k < dim; ++k) {
            numbers[k] = 0;
            store(rounded + k, 0.f * s);
        }
        return;
    }
#pragma omp simd
    for (int64_t k = 0; k < dim; ++k) {
        const float q = (to_float(x[k]) / divisor + ROUNDER) - ROUNDER;
        const float n = std::min(std::max(q, -LEVELS), LEVELS);
        numbers[k] = int8_t(int(n));
        store(rounded + k, n * s);
    }
}

template <typename T>
static const T* data(const Tensor& t) {
    return static_cast<const T*>(t.data_ptr());
}

// Every slot in [-1, slot_count) (-1: a padding token, not stored), or in [0, slot_count) without `padding`.
static void check_slots(const Tensor& slots, int64_t slot_count, bool padding, const char* op) {
    const int64_t* s = data<int64_t>(slots);
    for (int64_t i = 0; i < slots.numel(); ++i)
        if (s[i] >= slot_count || s[i] < (padding ? -1 : 0))
            throw std::invalid_argument(std::string(op) + ": slot " + std::to_string(s[i]) + " is outside the cache's " +
                                        std::to_string(slot_count) + " slots");
}

template <typename T>
static void store_vectors(const T* x, const int64_t* stride, const int64_t* slots, int8_t* numbers, float* scales,
                          T* rounded, int64_t B, int64_t H, int64_t T_, int64_t D) {
    const int threads = int(torch::stable::get_num_threads());
#pragma omp parallel for num_threads(threads) if (B * H * T_ * D >= PARALLEL_VALUES && threads > 1)
    for (int64_t token = 0; token < B * T_; ++token) {
        const int64_t b = token / T_, t = token % T_, slot = slots[token];
        int8_t unstored[D];  // a padding token's numbers and scale: computed, not kept
        float unstored_scale;
        for (int64_t h = 0; h < H; ++h)
            round_vector(x + b * stride[0] + h * stride[1] + t * stride[2], D,
                         slot < 0 ? unstored : numbers + (slot * H + h) * D,
                         slot < 0 ? &unstored_scale : scales + slot * H + h, rounded + ((b * H + h) * T_ + t) * D);
    }
}

// tformer::kv_store_int8(Tensor x, Tensor slots, Tensor(a!) numbers, Tensor(b!) scales) -> Tensor: keys or values
// x (B, Hkv, T, D) in bfloat16 or float32 (each vector contiguous) rounded into the cache's numbers (S, Hkv, D) and
// scales (S, Hkv) at slots (B * T,), b-major, -1 for a padding token; returns x as the cache holds it, (B, Hkv, T, D).
static Tensor kv_store_int8_op(Tensor x, Tensor slots, Tensor numbers, Tensor scales) {
    const bool bf16 = x.scalar_type() == ScalarType::BFloat16;
    if ((!bf16 && x.scalar_type() != ScalarType::Float) || x.dim() != 4 || x.stride(3) != 1 ||
        slots.scalar_type() != ScalarType::Long || !slots.is_contiguous() || slots.numel() != x.size(0) * x.size(2) ||
        numbers.scalar_type() != ScalarType::Char || numbers.dim() != 3 || !numbers.is_contiguous() ||
        numbers.size(1) != x.size(1) || numbers.size(2) != x.size(3) || scales.scalar_type() != ScalarType::Float ||
        scales.dim() != 2 || !scales.is_contiguous() || scales.size(0) != numbers.size(0) ||
        scales.size(1) != numbers.size(1))
        throw std::invalid_argument("kv_store_int8: x (B, Hkv, T, D) in bfloat16 or float32 with contiguous vectors, "
                                    "slots (B * T,) int64, numbers (S, Hkv, D) int8 and scales (S, Hkv) float32");
    check_slots(slots, numbers.size(0), true, "kv_store_int8");
    const int64_t B = x.size(0), H = x.size(1), T_ = x.size(2), D = x.size(3);
    const int64_t stride[3] = {x.stride(0), x.stride(1), x.stride(2)};
    Tensor rounded = torch::stable::new_empty(x, {B, H, T_, D});
    auto* into = static_cast<int8_t*>(numbers.data_ptr());
    auto* scale = static_cast<float*>(scales.data_ptr());
    if (bf16)
        store_vectors(data<uint16_t>(x), stride, data<int64_t>(slots), into, scale,
                      static_cast<uint16_t*>(rounded.data_ptr()), B, H, T_, D);
    else
        store_vectors(data<float>(x), stride, data<int64_t>(slots), into, scale,
                      static_cast<float*>(rounded.data_ptr()), B, H, T_, D);
    return rounded;
}

template <typename T>
static void read_vectors(const int8_t* numbers, const float* scales, const int64_t* slots, int64_t count, int64_t H,
                         int64_t D, T* out) {
    const int threads = int(torch::stable::get_num_threads());
#pragma omp parallel for num_threads(threads) if (count * H * D >= PARALLEL_VALUES && threads > 1)
    for (int64_t i = 0; i < count * H; ++i) {
        const int64_t at = slots[i / H] * H + i % H;
        const int8_t* n = numbers + at * D;
        const float s = scales[at];
#pragma omp simd
        for (int64_t k = 0; k < D; ++k) store(out + i * D + k, float(n[k]) * s);
    }
}

// tformer::kv_read_int8(Tensor numbers, Tensor scales, Tensor slots, bool bfloat16) -> Tensor: the keys or values
// stored at slots (any shape), (*slots.shape, Hkv, D), in bfloat16 or else float32.
static Tensor kv_read_int8_op(Tensor numbers, Tensor scales, Tensor slots, bool bfloat16) {
    if (numbers.scalar_type() != ScalarType::Char || numbers.dim() != 3 || !numbers.is_contiguous() ||
        scales.scalar_type() != ScalarType::Float || scales.dim() != 2 || !scales.is_contiguous() ||
        scales.size(0) != numbers.size(0) || scales.size(1) != numbers.size(1) ||
        slots.scalar_type() != ScalarType::Long || !slots.is_contiguous())
        throw std::invalid_argument("kv_read_int8: numbers (S, Hkv, D) int8, scales (S, Hkv) float32 and slots int64");
    check_slots(slots, numbers.size(0), false, "kv_read_int8");
    const int64_t H = numbers.size(1), D = numbers.size(2);
    std::vector<int64_t> shape;
    for (int64_t i = 0; i < slots.dim(); ++i) shape.push_back(slots.size(i));
    shape.push_back(H);
    shape.push_back(D);
    Tensor out = torch::stable::new_empty(scales, shape, bfloat16 ? ScalarType::BFloat16 : ScalarType::Float);
    const auto* n = data<int8_t>(numbers);
    if (bfloat16)
        read_vectors(n, data<float>(scales), data<int64_t>(slots), slots.numel(), H, D,
                     static_cast<uint16_t*>(out.data_ptr()));
    else
        read_vectors(n, data<float>(scales), data<int64_t>(slots), slots.numel(), H, D,
                     static_cast<float*>(out.data_ptr()));
    return out;
}

STABLE_TORCH_LIBRARY_IMPL(tformer, CPU, m) {
    m.impl("kv_store_int8", TORCH_BOX(&kv_store_int8_op));
    m.impl("kv_read_int8", TORCH_BOX(&kv_read_int8_op));
}
