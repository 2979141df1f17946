// One query per beam row over keys read in place through a slot table, the beams of a source together (see
// beam_attention.py).
//
// q (R, H, D): row r's query heads; k, v (slots, Hkv, D); slots (R, n): row r's keys at slots[r, 0 .. lengths[r]-1];
// rows s * G .. s * G + G - 1 are the G beams of one source s; every slot lies below num_slots (-1 returned, nothing
// computed, where one does not, or a length is outside 1 .. n; -2 without scratch memory). out (R, H, D) = softmax(scale q K^T) V, scores and sums
// in fp32. Query heads h * H / Hkv .. (h + 1) * H / Hkv - 1 read KV head h. One task per (source, KV head): its
// beams read keys their ancestors share, which the previous beam has just brought into the L1 cache, and no key is
// copied or converted ahead (the paged kernel converts each row's keys into a tile first, which in fp32 costs as
// much as the scores).
#include "native.h"

#include <omp.h>

#include "lanes.h"

#ifdef TFORMER_VECTOR_ATTENTION
constexpr int64_t MAX_CHUNKS = 256 / WIDTH;  // head_dim up to 256

// One query head of row r (its D floats at q) over its n keys of KV head g; CHUNKS = D / WIDTH when not 0
template <int64_t CHUNKS, typename T>
static void attend_query(const T* q, const T* k, const T* v, const int64_t* row_slots, int64_t n, int64_t Hkv,
                         int64_t g, int64_t D, float scale, float* scores, T* out) {
    const int64_t chunks = CHUNKS ? CHUNKS : D / WIDTH, grouped = n - n % 4;
    V query[MAX_CHUNKS];
    for (int64_t c = 0; c < chunks; ++c) query[c] = Lanes::mul(Lanes::load(q + c * WIDTH), Lanes::set1(scale));
    for (int64_t t = 0; t < grouped; t += 4) {
        const T* key[4];
        for (int64_t j = 0; j < 4; ++j) key[j] = k + (row_slots[t + j] * Hkv + g) * D;
        V dot[4];
        for (int64_t j = 0; j < 4; ++j) dot[j] = Lanes::mul(query[0], Lanes::load(key[j]));
        for (int64_t c = 1; c < chunks; ++c)
            for (int64_t j = 0; j < 4; ++j) dot[j] = Lanes::fmadd(query[c], Lanes::load(key[j] + c * WIDTH), dot[j]);
        Lanes::sum4(dot[0], dot[1], dot[2], dot[3], scores + t);
    }
    for (int64_t t = grouped; t < n; ++t) {
        const T* key = k + (row_slots[t] * Hkv + g) * D;
        V dot = Lanes::mul(query[0], Lanes::load(key));
        for (int64_t c = 1; c < chunks; ++c) dot = Lanes::fmadd(query[c], Lanes::load(key + c * WIDTH), dot);
        scores[t] = Lanes::reduce_add(dot);
    }
    softmax_in_place(scores, n);
    V acc[MAX_CHUNKS];
    for (int64_t c = 0; c < chunks; ++c) acc[c] = Lanes::zero();
    for (int64_t t = 0; t < n; ++t) {
        const T* value = v + (row_slots[t] * Hkv + g) * D;
        const V w = Lanes::set1(scores[t]);
        for (int64_t c = 0; c < chunks; ++c) acc[c] = Lanes::fmadd(w, Lanes::load(value + c * WIDTH), acc[c]);
    }
    alignas(64) float sums[MAX_CHUNKS * WIDTH];
    for (int64_t c = 0; c < chunks; ++c) Lanes::store(sums + c * WIDTH, acc[c]);
    for (int64_t d = 0; d < D; ++d) store(out + d, sums[d]);
}
#endif

// The same without vector instructions (or for head sizes that are not a multiple of WIDTH)
template <typename T>
static void attend_query_portable(const T* q, const T* k, const T* v, const int64_t* row_slots, int64_t n,
                                  int64_t Hkv, int64_t g, int64_t D, float scale, float* scores, T* out) {
    float top = -INFINITY;
    for (int64_t t = 0; t < n; ++t) {
        const T* key = k + (row_slots[t] * Hkv + g) * D;
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += to_float(q[d]) * to_float(key[d]);
        scores[t] = s * scale;
        top = std::fmax(top, scores[t]);
    }
    float total = 0.f;
    for (int64_t t = 0; t < n; ++t) total += (scores[t] = std::exp(scores[t] - top));
    std::vector<float> acc(D, 0.f);
    for (int64_t t = 0; t < n; ++t) {
        const T* value = v + (row_slots[t] * Hkv + g) * D;
        const float w = scores[t] / total;
        for (int64_t d = 0; d < D; ++d) acc[d] += w * to_float(value[d]);
    }
    for (int64_t d = 0; d < D; ++d) store(out + d, acc[d]);
}

template <typename T>
static int attend(const T* q, const T* k, const T* v, const int64_t* slots, const int64_t* lengths, T* out, int64_t R,
                  int64_t H, int64_t Hkv, int64_t D, int64_t max_keys, int64_t group, int64_t num_slots, float scale,
                  int threads) {
    for (int64_t r = 0; r < R; ++r) {  // every slot to read inside the cache, before reading any
        if (lengths[r] < 1 || lengths[r] > max_keys) return -1;
        for (int64_t t = 0; t < lengths[r]; ++t)
            if (slots[r * max_keys + t] < 0 || slots[r * max_keys + t] >= num_slots) return -1;
    }
    const int64_t rep = H / Hkv, sources = (R + group - 1) / group;
#ifdef TFORMER_VECTOR_ATTENTION
    const bool vectorized = D % WIDTH == 0 && D <= WIDTH * MAX_CHUNKS;
#endif
    int failed = 0;
    // a thread's share should outweigh waking it: a few thousand products at least
#pragma omp parallel num_threads(threads) if (threads > 1 && R * H * max_keys * D >= 65536)
    {
        const ScratchMemory memory(max_keys * sizeof(float));
        float* scores = static_cast<float*>(memory.data());
#pragma omp for schedule(static)
        for (int64_t task = 0; task < sources * Hkv; ++task) {
            if (!scores) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t s = task / Hkv, g = task % Hkv;
            for (int64_t r = s * group; r < std::min(R, (s + 1) * group); ++r) {
                const int64_t n = lengths[r];
                for (int64_t j = 0; j < rep; ++j) {
                    const int64_t head = (r * H + g * rep + j) * D;
#ifdef TFORMER_VECTOR_ATTENTION
                    if (vectorized) {
                        if (D == 64)
                            attend_query<64 / WIDTH>(q + head, k, v, slots + r * max_keys, n, Hkv, g, D, scale,
                                                     scores, out + head);
                        else
                            attend_query<0>(q + head, k, v, slots + r * max_keys, n, Hkv, g, D, scale, scores,
                                            out + head);
                        continue;
                    }
#endif
                    attend_query_portable(q + head, k, v, slots + r * max_keys, n, Hkv, g, D, scale, scores,
                                          out + head);
                }
            }
        }
    }
    return failed ? -2 : 0;
}

extern "C" {
int beam_attention_f32(const float* q, const float* k, const float* v, const int64_t* slots, const int64_t* lengths,
                       float* out, int64_t R, int64_t H, int64_t Hkv, int64_t D, int64_t max_keys, int64_t group,
                       int64_t num_slots, float scale, int threads) {
    return attend(q, k, v, slots, lengths, out, R, H, Hkv, D, max_keys, group, num_slots, scale, threads);
}
int beam_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* slots,
                        const int64_t* lengths, uint16_t* out, int64_t R, int64_t H, int64_t Hkv, int64_t D,
                        int64_t max_keys, int64_t group, int64_t num_slots, float scale, int threads) {
    return attend(q, k, v, slots, lengths, out, R, H, Hkv, D, max_keys, group, num_slots, scale, threads);
}
}
