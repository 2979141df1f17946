// Causal attention of prompt chunks in fp32 over bfloat16 or float32 tensors: see causal_attention.py.
// Built by tformer.inference.native.load with the machine's C++ compiler (-O3 -march=native -fopenmp), against
// torch's stable C ABI, which registers the op at the end.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "native.h"

#include "lanes.h"

using torch::stable::Tensor;

// Where q, k, v and the output lie: sizes, and strides of their batch, head and token dimensions (the last,
// head_dim, is contiguous). Query t sits at key slot Tk - T + t and sees the keys up to that slot.
struct Layout {
    int64_t B, H, Hkv, T, Tk, D;
    int64_t q[3], k[3], v[3], out[3];
};

#ifdef TFORMER_VECTOR_ATTENTION
constexpr int64_t BLOCK_QUERIES = 16;  // queries of each query head a task takes, over one KV head
constexpr int64_t TILES = 2;           // registers of keys a step scores: KEYS keys, one softmax update a row
constexpr int64_t KEYS = TILES * WIDTH;
// Query rows scored together, so that each load of keys serves them all: as many as the registers allow (AVX-512
// has 32, AVX2 16), ROWS_AT_ONCE x TILES sums and TILES loads.
constexpr int64_t ROWS_AT_ONCE = WIDTH == 16 ? 8 : 4;

// The floats a task's scratch holds: rows x D queries and sums, rows x KEYS weights, and each row's top score,
// weight sum and rescaling factor.
static int64_t scratch_floats(int64_t rows, int64_t D) { return 2 * rows * D + rows * KEYS + 3 * rows; }

// KV head g of batch row b as floats, once for all its tasks: keys transposed (D x width, so that a register holds
// one dimension of WIDTH keys) and values (width x D), zeros past the Tk keys up to `width`, a multiple of KEYS.
template <typename T>
static void convert_head(const T* k, const T* v, const Layout& s, int64_t b, int64_t g, int64_t width, float* keys,
                         float* values) {
    const T* key = k + b * s.k[0] + g * s.k[1];
    const T* value = v + b * s.v[0] + g * s.v[1];
    for (int64_t j = 0; j < width; ++j) {
        for (int64_t d = 0; d < s.D; ++d) keys[d * width + j] = j < s.Tk ? to_float(key[j * s.k[2] + d]) : 0.f;
        for (int64_t c = 0; c < s.D; c += WIDTH)
            Lanes::store(values + j * s.D + c, j < s.Tk ? Lanes::load(value + j * s.v[2] + c) : Lanes::zero());
    }
}

// One task: query heads g * rep .. (g + 1) * rep - 1 of batch row b, queries q0 .. q0 + BLOCK_QUERIES - 1 (as
// `rows` rows, query head by query head, padded to a multiple of ROWS_AT_ONCE), against KV head g: flash
// attention's online softmax over KEYS keys at a time, the keys in the lanes of each score register.
template <typename T>
static void attend_block(const T* q, const float* KT, const float* VT, int64_t width, T* out, const Layout& s,
                         int64_t b, int64_t g, int64_t q0, float scale, float* scratch) {
    const int64_t rep = s.H / s.Hkv, n = std::min(BLOCK_QUERIES, s.T - q0), D = s.D;
    const int64_t used = rep * n, rows = (used + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE * ROWS_AT_ONCE;
    float *Q = scratch, *O = Q + rows * D, *P = O + rows * D;
    float *top = P + rows * KEYS, *total = top + rows, *rescale = total + rows;
    const auto row_query = [&](int64_t r) { return std::min(r, used - 1) % n; };  // padding rows repeat the last
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t head = g * rep + std::min(r, used - 1) / n;
        const T* from = q + b * s.q[0] + head * s.q[1] + (q0 + row_query(r)) * s.q[2];
        for (int64_t c = 0; c < D; c += WIDTH)
            Lanes::store(Q + r * D + c, Lanes::mul(Lanes::load(from + c), Lanes::set1(scale)));
        std::fill(O + r * D, O + (r + 1) * D, 0.f);
        top[r] = -INFINITY, total[r] = 0.f;
    }
    const int64_t offset = s.Tk - s.T, last = offset + q0 + n - 1;  // the block's last query sees keys 0 .. last
    const V lanes = Lanes::lane_index();
    for (int64_t j0 = 0; j0 <= last; j0 += KEYS) {
        const int64_t m = std::min(KEYS, last + 1 - j0);
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS_AT_ONCE) {
            V score[ROWS_AT_ONCE][TILES];
            for (int64_t i = 0; i < ROWS_AT_ONCE; ++i)
                for (int64_t t = 0; t < TILES; ++t) score[i][t] = Lanes::zero();
            for (int64_t d = 0; d < D; ++d) {
                V column[TILES];
                for (int64_t t = 0; t < TILES; ++t) column[t] = Lanes::load(KT + d * width + j0 + t * WIDTH);
                for (int64_t i = 0; i < ROWS_AT_ONCE; ++i) {
                    const V query = Lanes::set1(Q[(r0 + i) * D + d]);
                    for (int64_t t = 0; t < TILES; ++t) score[i][t] = Lanes::fmadd(query, column[t], score[i][t]);
                }
            }
            for (int64_t i = 0; i < ROWS_AT_ONCE; ++i) {
                const int64_t r = r0 + i;
                const float visible = float(offset + q0 + row_query(r) - j0);  // the row's last visible key here
                V limit[TILES], masked[TILES], weights[TILES];
                V most = Lanes::set1(-INFINITY), sum = Lanes::zero();
                for (int64_t t = 0; t < TILES; ++t) {
                    limit[t] = Lanes::set1(visible - float(t * WIDTH));
                    masked[t] = Lanes::fill_above(score[i][t], lanes, limit[t], Lanes::set1(-INFINITY));
                    most = Lanes::max(most, masked[t]);
                }
                const float best = std::fmax(top[r], Lanes::reduce_max(most));
                for (int64_t t = 0; t < TILES; ++t) {
                    const V e = exp_lanes(Lanes::sub(masked[t], Lanes::set1(best)));
                    weights[t] = Lanes::fill_above(e, lanes, limit[t], Lanes::zero());
                    sum = Lanes::add(sum, weights[t]);
                    Lanes::store(P + r * KEYS + t * WIDTH, weights[t]);
                }
                rescale[r] = std::exp(top[r] - best);  // 0 before the first key
                total[r] = total[r] * rescale[r] + Lanes::reduce_add(sum);
                top[r] = best;
            }
            for (int64_t c = 0; c < D; c += WIDTH) {
                V sums[ROWS_AT_ONCE];
                for (int64_t i = 0; i < ROWS_AT_ONCE; ++i)
                    sums[i] = Lanes::mul(Lanes::load(O + (r0 + i) * D + c), Lanes::set1(rescale[r0 + i]));
                for (int64_t j = 0; j < m; ++j) {
                    const V value = Lanes::load(VT + (j0 + j) * D + c);
                    for (int64_t i = 0; i < ROWS_AT_ONCE; ++i)
                        sums[i] = Lanes::fmadd(Lanes::set1(P[(r0 + i) * KEYS + j]), value, sums[i]);
                }
                for (int64_t i = 0; i < ROWS_AT_ONCE; ++i) Lanes::store(O + (r0 + i) * D + c, sums[i]);
            }
        }
    }
    for (int64_t r = 0; r < used; ++r) {
        T* to = out + b * s.out[0] + (g * rep + r / n) * s.out[1] + (q0 + r % n) * s.out[2];
        const float inverse = 1.f / total[r];
        for (int64_t d = 0; d < D; ++d) store(to + d, O[r * D + d] * inverse);
    }
}

// Every KV head converted (in parallel), then every task, spread over `threads` threads (later query blocks see more
// keys: dynamic schedule). Returns -2 without memory for the converted heads or the scratch.
template <typename T>
static int attend(const T* q, const T* k, const T* v, T* out, const Layout& s, int threads) {
    const int64_t blocks = (s.T + BLOCK_QUERIES - 1) / BLOCK_QUERIES, rep = s.H / s.Hkv;
    const int64_t rows = (rep * BLOCK_QUERIES + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE * ROWS_AT_ONCE;
    const int64_t width = (s.Tk + KEYS - 1) / KEYS * KEYS, head_floats = 2 * width * s.D;
    const float scale = float(std::pow(double(s.D), -0.5));  // as Python's D ** -0.5
    std::unique_ptr<float[]> heads(new (std::nothrow) float[s.B * s.Hkv * head_floats]);
    if (!heads) return -2;
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for collapse(2)
        for (int64_t b = 0; b < s.B; ++b) {
            for (int64_t g = 0; g < s.Hkv; ++g) {
                float* head = heads.get() + (b * s.Hkv + g) * head_floats;
                convert_head(k, v, s, b, g, width, head, head + width * s.D);
            }
        }
        const ScratchMemory memory(scratch_floats(rows, s.D) * sizeof(float));
        float* scratch = static_cast<float*>(memory.data());
        #pragma omp for collapse(3) schedule(dynamic, 1)
        for (int64_t b = 0; b < s.B; ++b) {
            for (int64_t g = 0; g < s.Hkv; ++g) {
                for (int64_t block = blocks - 1; block >= 0; --block) {  // the longest first
                    if (!scratch) {
                        #pragma omp atomic write
                        failed = 1;
                        continue;
                    }
                    const float* head = heads.get() + (b * s.Hkv + g) * head_floats;
                    attend_block(q, head, head + width * s.D, width, out, s, b, g, block * BLOCK_QUERIES, scale,
                                 scratch);
                }
            }
        }
    }
    return failed ? -2 : 0;
}
#endif

extern "C" int causal_attention_width() {  // the head sizes the kernel takes are multiples of this; 0: none
#ifdef TFORMER_VECTOR_ATTENTION
    return int(WIDTH);
#else
    return 0;
#endif
}

// tformer::causal_attention(Tensor q, Tensor k, Tensor v) -> Tensor, defined in causal_attention.py: q (B, H, T, D),
// k and v (B, Hkv, Tk, D) with Tk >= T, each with a contiguous last dimension; returns (B, H, T, D), contiguous.
static Tensor causal_attention_op(Tensor q, Tensor k, Tensor v) {
    using torch::headeronly::ScalarType;
    if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
        throw std::invalid_argument("causal_attention: q, k and v must be (batch, heads, tokens, head_dim)");
    const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), Tk = k.size(2);
    for (const Tensor* t : {&k, &v})
        if (t->size(0) != B || t->size(1) != Hkv || t->size(2) != Tk || t->size(3) != D)
            throw std::invalid_argument("causal_attention: k and v must have one shape, (B, Hkv, Tk, D)");
    if (Hkv == 0 || H % Hkv || Tk < T || T == 0)
        throw std::invalid_argument("causal_attention: H must be a multiple of Hkv, and 0 < T <= Tk");
    const ScalarType dtype = q.scalar_type();
    if ((dtype != ScalarType::BFloat16 && dtype != ScalarType::Float) || k.scalar_type() != dtype ||
        v.scalar_type() != dtype)
        throw std::invalid_argument("causal_attention: q, k and v must share one dtype of bfloat16 and float32");
    if (q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1)
        throw std::invalid_argument("causal_attention: head_dim must be contiguous in q, k and v");
    if (causal_attention_width() == 0 || D % causal_attention_width())
        throw std::invalid_argument("causal_attention: head_dim must be a multiple of " +
                                    std::to_string(causal_attention_width()) + " in this build");
    Tensor out = torch::stable::new_empty(q, {B, H, T, D});
    Layout s{B, H, Hkv, T, Tk, D, {q.stride(0), q.stride(1), q.stride(2)}, {k.stride(0), k.stride(1), k.stride(2)},
             {v.stride(0), v.stride(1), v.stride(2)}, {H * T * D, T * D, D}};
    int status = 0;
#ifdef TFORMER_VECTOR_ATTENTION
    const int threads = int(torch::stable::get_num_threads());
    const auto run = [&](auto* kind) {  // the element type of all four tensors, as a null pointer
        using T = std::remove_pointer_t<decltype(kind)>;
        return attend(static_cast<const T*>(q.data_ptr()), static_cast<const T*>(k.data_ptr()),
                      static_cast<const T*>(v.data_ptr()), static_cast<T*>(out.data_ptr()), s, threads);
    };
    status = dtype == ScalarType::BFloat16 ? run(static_cast<uint16_t*>(nullptr)) : run(static_cast<float*>(nullptr));
#endif
    if (status == -2) throw std::runtime_error("causal_attention: out of memory for its scratch buffers");
    return out;
}

STABLE_TORCH_LIBRARY_IMPL(tformer, CPU, m) {
    m.impl("causal_attention", TORCH_BOX(&causal_attention_op));
}
