// Decode attention over a paged KV cache, reading each row's keys and values where they lie: see paged_attention.py.
// The cache holds q's dtype (T), or int8 (C = int8_t) with a float32 scale per (slot, KV head), dequantized where the
// keys and values become floats anyway. Built by tformer.inference.native.load with the machine's C++ compiler
// (-O3 -march=native -fopenmp), against torch's stable C ABI, which registers the ops at the end.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "native.h"

using torch::stable::Tensor;

#include "lanes.h"

// Whether a cache of C holds int8 integers that a scale per (slot, KV head) turns into its values
template <typename C>
constexpr bool QUANTIZED = std::is_same_v<C, int8_t>;

#ifdef TFORMER_VECTOR_ATTENTION

constexpr int64_t MAX_CHUNKS = 256 / WIDTH;  // head_dim up to 256
constexpr int64_t KEYS_AT_ONCE = 4;          // keys scored together, their 4 dot products summed in one pass
constexpr int64_t TILE_KEYS = 32;            // keys converted at a time: SmolLM2's 3 KV heads of 64 floats, 24 KB
// Keys ahead to prefetch. 32 rows x ~130 keys of SmolLM2 in bf16, 30 layers' caches in DRAM (2 cores, AVX-512,
// 2026-12-02): 428-456 us a layer without prefetching, 308-322 at 8 keys ahead, 278-284 at 16, 247-252 at 32.
constexpr int64_t PREFETCH_AHEAD = 32;

// KV heads g0 .. g0 + heads - 1 of the cache's rows 0 .. m-1 (of n), copied as floats into `tile` (heads x m x D):
// each slot's heads are read together (side by side in the cache), and every query head sharing a KV head then
// reads one contiguous, converted copy that stays in the L1 cache. An int8 cache's heads are multiplied by their
// `scales` on the way, so that all that follows is the same for every cache.
template <typename C>
static void gather_tile(const C* cache, const float* scales, const int64_t* row_slots, int64_t m, int64_t n,
                        int64_t Hkv, int64_t g0, int64_t heads, int64_t D, float* tile) {
    const int64_t row_bytes = heads * D * int64_t(sizeof(C));
    for (int64_t t = 0; t < m; ++t) {
        const int64_t at = row_slots[t] * Hkv + g0;  // the slot's first head
        const C* row = cache + at * D;
        // the cache is larger than the CPU's caches: ask for rows (and an int8 cache's scales) in time
        if (t + PREFETCH_AHEAD < n) {
            const int64_t ahead = row_slots[t + PREFETCH_AHEAD] * Hkv + g0;
            prefetch(cache + ahead * D, row_bytes);
            if constexpr (QUANTIZED<C>) prefetch(scales + ahead, heads * int64_t(sizeof(float)));
        }
        for (int64_t h = 0; h < heads; ++h) {
            float* into = tile + (h * m + t) * D;
            if constexpr (QUANTIZED<C>) {
                const V scale = Lanes::set1(scales[at + h]);
                for (int64_t c = 0; c < D; c += WIDTH)
                    Lanes::store(into + c, Lanes::mul(Lanes::load(row + h * D + c), scale));
            } else {
                for (int64_t c = 0; c < D; c += WIDTH) Lanes::store(into + c, Lanes::load(row + h * D + c));
            }
        }
    }
}

// One row's KV heads g0 .. g0 + heads - 1 and their query heads (rep each, q and out starting at the first):
// scores, softmax and the weighted sum of values, WIDTH lanes at a time, over tiles of TILE_KEYS keys. D % WIDTH == 0,
// and D == CHUNKS * WIDTH when CHUNKS is not 0 (the common head sizes, whose loops the compiler then unrolls so that
// a query head's D floats and its value sums stay in registers). `scratch` holds attend_scratch_floats floats.
// With `part`, each query head's sums before the softmax's division go there instead, then its top score and the
// sum of its keys' weights (D + 2 floats a query head), for `merge_parts`. k_scale and v_scale: an int8 cache's
// (gather_tile), else unused.
template <int64_t CHUNKS, typename T, typename C>
static void attend_one(const T* q, const C* k, const C* v, const float* k_scale, const float* v_scale,
                       const int64_t* row_slots, int64_t n, int64_t Hkv, int64_t g0, int64_t heads, int64_t rep,
                       int64_t D, float scale, float* scratch, T* out, float* part) {
    const int64_t chunks = CHUNKS ? CHUNKS : D / WIDTH, queries = heads * rep;
    float *scores = scratch, *sums = scores + queries * n, *tile = sums + queries * D;
    for (int64_t t0 = 0; t0 < n; t0 += TILE_KEYS) {
        const int64_t m = std::min(TILE_KEYS, n - t0), grouped = m - m % KEYS_AT_ONCE;
        gather_tile(k, k_scale, row_slots + t0, m, n - t0, Hkv, g0, heads, D, tile);
        for (int64_t r = 0; r < queries; ++r) {
            const float* rows = tile + (r / rep) * m * D;
            float* sr = scores + r * n + t0;
            V query[MAX_CHUNKS];
            for (int64_t c = 0; c < chunks; ++c)
                query[c] = Lanes::mul(Lanes::load(q + r * D + c * WIDTH), Lanes::set1(scale));
            for (int64_t t = 0; t < grouped; t += KEYS_AT_ONCE) {
                const float* key = rows + t * D;
                V dot[KEYS_AT_ONCE];
                for (int64_t j = 0; j < KEYS_AT_ONCE; ++j) dot[j] = Lanes::mul(query[0], Lanes::load(key + j * D));
                for (int64_t c = 1; c < chunks; ++c) {
                    for (int64_t j = 0; j < KEYS_AT_ONCE; ++j)
                        dot[j] = Lanes::fmadd(query[c], Lanes::load(key + j * D + c * WIDTH), dot[j]);
                }
                Lanes::sum4(dot[0], dot[1], dot[2], dot[3], sr + t);
            }
            for (int64_t t = grouped; t < m; ++t) {
                V dot = Lanes::mul(query[0], Lanes::load(rows + t * D));
                for (int64_t c = 1; c < chunks; ++c)
                    dot = Lanes::fmadd(query[c], Lanes::load(rows + t * D + c * WIDTH), dot);
                sr[t] = Lanes::reduce_add(dot);
            }
        }
    }
    for (int64_t r = 0; r < queries; ++r) softmax_in_place(scores + r * n, n, part ? part + r * (D + 2) + D : nullptr);
    std::fill(sums, sums + queries * D, 0.f);
    for (int64_t t0 = 0; t0 < n; t0 += TILE_KEYS) {
        const int64_t m = std::min(TILE_KEYS, n - t0);
        gather_tile(v, v_scale, row_slots + t0, m, n - t0, Hkv, g0, heads, D, tile);
        for (int64_t r = 0; r < queries; ++r) {
            const float *rows = tile + (r / rep) * m * D, *sr = scores + r * n + t0;
            V acc[MAX_CHUNKS];
            for (int64_t c = 0; c < chunks; ++c) acc[c] = Lanes::load(sums + r * D + c * WIDTH);
            for (int64_t t = 0; t < m; ++t) {
                const V w = Lanes::set1(sr[t]);
                const float* value = rows + t * D;
                for (int64_t c = 0; c < chunks; ++c) acc[c] = Lanes::fmadd(w, Lanes::load(value + c * WIDTH), acc[c]);
            }
            for (int64_t c = 0; c < chunks; ++c) Lanes::store(sums + r * D + c * WIDTH, acc[c]);
        }
    }
    if (part)
        for (int64_t r = 0; r < queries; ++r) std::copy(sums + r * D, sums + (r + 1) * D, part + r * (D + 2));
    else
        for (int64_t i = 0; i < queries * D; ++i) store(out + i, sums[i]);
}

// The floats attend_one's scratch holds for `heads` KV heads of a row of up to max_keys keys
static int64_t attend_scratch_floats(int64_t heads, int64_t rep, int64_t D, int64_t max_keys) {
    return heads * (rep * (max_keys + D) + TILE_KEYS * D);
}

// attend_one for D = chunks * WIDTH, its loops unrolled for the common head sizes
template <typename... Args>
static void attend_vectorized(int64_t chunks, Args... args) {
    switch (chunks) {
        case 64 / WIDTH: return attend_one<64 / WIDTH>(args...);
        case 128 / WIDTH: return attend_one<128 / WIDTH>(args...);
        default: return attend_one<0>(args...);
    }
}
#endif

constexpr int64_t MIN_SPLIT_KEYS = 256;  // the fewest keys a row's task splits into parts for (see attend)

// One query head's output from what attend_one left for its `parts` key ranges (`stride` floats apart): the ranges'
// sums and weights' sums, each weighed by e^(its top - the top of all). A range without keys takes no part.
template <typename T>
static void merge_parts(float* first, int64_t parts, int64_t stride, int64_t D, T* out) {
    float top = -INFINITY, total = 0.f;
    for (int64_t p = 0; p < parts; ++p) top = std::fmax(top, first[p * stride + D]);  // -inf where a range is empty
    for (int64_t p = 0; p < parts; ++p) {
        float* at = first + p * stride;
        at[D] = at[D + 1] != 0.f ? std::exp(at[D] - top) : 0.f;  // the range's weight, in place of its top
        total += at[D] * at[D + 1];
    }
    for (int64_t d = 0; d < D; ++d) {
        float sum = 0.f;
        for (int64_t p = 0; p < parts; ++p) sum += first[p * stride + D] * first[p * stride + d];
        store(out + d, total != 0.f ? sum / total : 0.f);  // a row without keys: zeros, as without parts
    }
}

// One (row, KV head) without vector instructions, or for head sizes that are not a multiple of WIDTH. `scratch`
// holds rep x D scaled queries, rep x D value sums and rep x n scores. An int8 cache's key scale multiplies the
// key's score, and its value scale the value's weight: once a key rather than once an element.
template <typename T, typename C>
static void attend_one_portable(const T* q, const C* k, const C* v, const float* k_scale, const float* v_scale,
                                const int64_t* row_slots, int64_t n, int64_t Hkv, int64_t g, int64_t rep, int64_t D,
                                float scale, float* scratch, T* out) {
    float *query = scratch, *acc = scratch + rep * D, *scores = scratch + 2 * rep * D;
    for (int64_t i = 0; i < rep * D; ++i) query[i] = to_float(q[i]) * scale;
    for (int64_t t = 0; t < n; ++t) {
        const C* key = k + (row_slots[t] * Hkv + g) * D;
        for (int64_t r = 0; r < rep; ++r) {
            const float* qr = query + r * D;
            float s = 0.f;
            #pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qr[d] * to_float(key[d]);
            if constexpr (QUANTIZED<C>) s *= k_scale[row_slots[t] * Hkv + g];
            scores[r * n + t] = s;
        }
    }
    for (int64_t r = 0; r < rep; ++r) {
        float* sr = scores + r * n;
        float top = -INFINITY;
        for (int64_t t = 0; t < n; ++t) top = sr[t] > top ? sr[t] : top;
        float total = 0.f;
        for (int64_t t = 0; t < n; ++t) {
            sr[t] = std::exp(sr[t] - top);
            total += sr[t];
        }
        float inverse = n > 0 ? 1.f / total : 0.f;
        for (int64_t t = 0; t < n; ++t) sr[t] *= inverse;
    }
    std::fill(acc, acc + rep * D, 0.f);
    for (int64_t t = 0; t < n; ++t) {
        const C* value = v + (row_slots[t] * Hkv + g) * D;
        for (int64_t r = 0; r < rep; ++r) {
            float w = scores[r * n + t];
            if constexpr (QUANTIZED<C>) w *= v_scale[row_slots[t] * Hkv + g];
            float* ar = acc + r * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) ar[d] += w * to_float(value[d]);
        }
    }
    for (int64_t i = 0; i < rep * D; ++i) store(out + i, acc[i]);
}

// q (B, H, D), k and v (num_slots, Hkv, D), slots (B, max_keys): row b reads keys slots[b, 0 .. lengths[b] - 1].
// k_scale and v_scale (num_slots, Hkv): an int8 cache's, else unused. Returns 0, -1 (computing nothing) when a slot
// it would read lies outside the cache, or -2 without scratch memory.
template <typename T, typename C>
static int attend(const T* q, const C* k, const C* v, const float* k_scale, const float* v_scale, const int64_t* slots,
                  const int64_t* lengths, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t max_keys,
                  int64_t num_slots, float scale, int threads, T* out) {
    for (int64_t b = 0; b < B; ++b) {
        const int64_t n = lengths[b] < max_keys ? lengths[b] : max_keys;
        for (int64_t t = 0; t < n; ++t) {
            if (slots[b * max_keys + t] < 0 || slots[b * max_keys + t] >= num_slots) return -1;
        }
    }
    const int64_t rep = H / Hkv;
#ifdef TFORMER_VECTOR_ATTENTION
    const bool vectorized = D % WIDTH == 0 && D <= WIDTH * MAX_CHUNKS;
#else
    const bool vectorized = false;
#endif
    // A task is one row's KV heads together (each slot's heads lie side by side in the cache) when there are enough
    // rows to share out, else one (row, KV head) so that a few long rows still keep every thread busy.
    const int64_t heads = vectorized && B >= 4 * threads ? Hkv : 1;
    // Fewer tasks than twice the threads (one long row, 3 KV heads on 2 threads): each task's keys split into
    // `parts` ranges, whose results merge_parts joins, so that every thread gets an equal share.
    const int64_t parts = vectorized && B * Hkv < 2 * threads && max_keys >= MIN_SPLIT_KEYS ? threads : 1;
    std::vector<float> results(parts > 1 ? parts * B * H * (D + 2) : 0);
    size_t scratch_floats = rep * (2 * D + max_keys);  // attend_one_portable's
#ifdef TFORMER_VECTOR_ATTENTION
    if (vectorized) scratch_floats = attend_scratch_floats(heads, rep, D, (max_keys + parts - 1) / parts);
#endif
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        const ScratchMemory memory(scratch_floats * sizeof(float));
        float* scratch = static_cast<float*>(memory.data());
        #pragma omp for collapse(3) schedule(dynamic, 1)
        for (int64_t b = 0; b < B; ++b) {
            for (int64_t g = 0; g < Hkv; g += heads) {
                for (int64_t p = 0; p < parts; ++p) {
                    if (!scratch) {
                        #pragma omp atomic write
                        failed = 1;
                        continue;
                    }
                    const int64_t n = lengths[b] < max_keys ? lengths[b] : max_keys, first = b * H + g * rep;
                    const int64_t share = (n + parts - 1) / parts, start = std::min(n, p * share);
                    const int64_t* row_slots = slots + b * max_keys + start;
#ifdef TFORMER_VECTOR_ATTENTION
                    if (vectorized) {
                        float* part = parts > 1 ? results.data() + (p * B * H + first) * (D + 2) : nullptr;
                        attend_vectorized(D / WIDTH, q + first * D, k, v, k_scale, v_scale, row_slots,
                                          std::min(share, n - start), Hkv, g, heads, rep, D, scale, scratch,
                                          out + first * D, part);
                        continue;
                    }
#endif
                    attend_one_portable(q + first * D, k, v, k_scale, v_scale, row_slots, n, Hkv, g, rep, D, scale,
                                        scratch, out + first * D);
                }
            }
        }
        #pragma omp for
        for (int64_t i = 0; i < (parts > 1 && !failed ? B * H : 0); ++i)
            merge_parts(results.data() + i * (D + 2), parts, B * H * (D + 2), D, out + i * D);
    }
    return failed ? -2 : 0;
}

// tformer::paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lengths) -> Tensor and
// tformer::paged_decode_attention_int8(Tensor q, Tensor k, Tensor v, Tensor k_scale, Tensor v_scale, Tensor slots,
// Tensor lengths) -> Tensor, defined in paged_attention.py: `op` names the op, whose scales (an int8 cache's) are
// given or nullptr. The checks repeat the ones the kernel relies on (metadata only: no tensor is read before).
static Tensor attend_op(const std::string& op, Tensor q, Tensor k, Tensor v, const Tensor* k_scale,
                        const Tensor* v_scale, Tensor slots, Tensor lengths) {
    using torch::headeronly::ScalarType;
    if (q.dim() != 4 || q.size(2) != 1) throw std::invalid_argument(op + " takes one query per row, q (B, H, 1, D)");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
    if (k.dim() != 3 || v.dim() != 3 || k.size(0) != v.size(0) || k.size(1) != v.size(1) || k.size(2) != v.size(2) ||
        k.size(2) != D || k.size(1) == 0 || H % k.size(1))
        throw std::invalid_argument(op + ": k and v must be the cache's (slots, Hkv, D) tensors with H a multiple of "
                                         "Hkv");
    if (!k.is_contiguous() || !v.is_contiguous())
        throw std::invalid_argument(op + ": k and v must be contiguous (the paged cache's own tensors)");
    const ScalarType dtype = q.scalar_type(), cache = k_scale ? ScalarType::Char : dtype;
    const bool bf16 = dtype == ScalarType::BFloat16;
    if ((!bf16 && dtype != ScalarType::Float) || k.scalar_type() != cache || v.scalar_type() != cache) {
        if (k_scale) throw std::invalid_argument(op + ": q must be bfloat16 or float32, and k and v int8");
        const bool int8 = k.scalar_type() == ScalarType::Char;  // the scales forgotten?
        throw std::invalid_argument(op + ": q, k and v must share one dtype of bfloat16 and float32" +
                                    (int8 ? " (an int8 cache takes its k_scale and v_scale)" : ""));
    }
    for (const Tensor* scales : {k_scale, v_scale}) {
        if (scales && (scales->scalar_type() != ScalarType::Float || scales->dim() != 2 ||
                       scales->size(0) != k.size(0) || scales->size(1) != k.size(1) || !scales->is_contiguous()))
            throw std::invalid_argument(op + ": k_scale and v_scale must be contiguous float32 (slots, Hkv) tensors, "
                                             "one scale for each head of the cache");
    }
    if (slots.scalar_type() != ScalarType::Long || lengths.scalar_type() != ScalarType::Long || slots.dim() != 2 ||
        slots.size(0) != B || lengths.dim() != 1 || lengths.size(0) != B)
        throw std::invalid_argument(op + ": slots must be int64 (B, max_keys) and lengths int64 (B,)");
    if (!q.is_contiguous()) q = torch::stable::contiguous(q);
    if (!slots.is_contiguous()) slots = torch::stable::contiguous(slots);
    if (!lengths.is_contiguous()) lengths = torch::stable::contiguous(lengths);
    Tensor out = torch::stable::new_empty(q, {B, H, 1, D});
    const int64_t Hkv = k.size(1), max_keys = slots.size(1), num_slots = k.size(0);
    const float scale = float(std::pow(double(D), -0.5));  // as Python's D ** -0.5
    const int threads = int(torch::stable::get_num_threads());
    const auto* slot_ids = static_cast<const int64_t*>(slots.data_ptr());
    const auto* counts = static_cast<const int64_t*>(lengths.data_ptr());
    const auto* k_scales = k_scale ? static_cast<const float*>(k_scale->data_ptr()) : nullptr;
    const auto* v_scales = v_scale ? static_cast<const float*>(v_scale->data_ptr()) : nullptr;
    const auto attend_as = [&](auto q_type, auto cache_type) {  // q and out of T, a cache of C
        using T = decltype(q_type);
        using C = decltype(cache_type);
        return attend(static_cast<const T*>(q.data_ptr()), static_cast<const C*>(k.data_ptr()),
                      static_cast<const C*>(v.data_ptr()), k_scales, v_scales, slot_ids, counts, B, H, Hkv, D,
                      max_keys, num_slots, scale, threads, static_cast<T*>(out.data_ptr()));
    };
    const int status = k_scale ? (bf16 ? attend_as(uint16_t(), int8_t()) : attend_as(float(), int8_t()))
                               : (bf16 ? attend_as(uint16_t(), uint16_t()) : attend_as(float(), float()));
    if (status == -2) throw std::runtime_error(op + ": out of memory for its scratch buffers");
    if (status)
        throw std::out_of_range(op + ": a slot to read lies outside the cache's " + std::to_string(num_slots) +
                                " slots");
    return out;
}

static Tensor paged_decode_attention_op(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lengths) {
    return attend_op("paged_decode_attention", q, k, v, nullptr, nullptr, slots, lengths);
}

static Tensor paged_decode_attention_int8_op(Tensor q, Tensor k, Tensor v, Tensor k_scale, Tensor v_scale,
                                             Tensor slots, Tensor lengths) {
    return attend_op("paged_decode_attention_int8", q, k, v, &k_scale, &v_scale, slots, lengths);
}

STABLE_TORCH_LIBRARY_IMPL(tformer, CPU, m) {
    m.impl("paged_decode_attention", TORCH_BOX(&paged_decode_attention_op));
    m.impl("paged_decode_attention_int8", TORCH_BOX(&paged_decode_attention_int8_op));
}
