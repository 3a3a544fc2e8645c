// Decode attention read in place from the paged KV pool.
//
// One query token per sequence attends to the keys and values of its own blocks,
// found through its block table: nothing is gathered into a padded copy, so a step
// reads each cached token once and pads nothing. Work items are (sequence, part of
// its context), spread over torch's own OpenMP pool (at::parallel_for); each scores
// every query head against its keys, then sums its values, and the parts of a
// sequence are merged by their softmax state. Accumulation is float32 whatever the
// cache dtype.
//
// Built at run time by splitserve.services.engine.kernels.build (g++, -march=native
// for the CPU it runs on) and called through ctypes with raw pointers: the caller
// (model/paged_attention.py) checks shapes, dtypes, devices and contiguity.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// Eight floats, loaded from and stored to any 4-byte aligned address (GCC vector extension:
// AVX2 on the machines here, split into SSE halves by the compiler elsewhere).
typedef float v8 __attribute__((vector_size(32), aligned(4)));
constexpr int64_t W = 8;
constexpr int64_t kPartTokens = 256;  // context tokens per work item

struct DecodeShape {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, window;
  float scale;
};

inline float hsum(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// One token's K or V row of one KV head as float32: in place for float, converted otherwise.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t hd) {
  for (int64_t i = 0; i < hd; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) { return src; }

// Softmax state of one query head over one part of the context: running max, sum of
// exponentials and the unnormalised weighted sum of values (flash-decoding's partials).
struct Partial {
  float max, sum;
};

// Calls fn(pos, row) for tokens [lo, hi) of one sequence, block by block through its table:
// row is that token's K (or V) of every KV head, as float32.
template <typename T, typename F>
inline void for_each_row(const T* cache, const int64_t* table, int64_t lo, int64_t hi, const DecodeShape& s,
                         float* buf, F&& fn) {
  const int64_t token_stride = s.num_kv_heads * s.head_dim;
  const int64_t block_stride = s.block_size * token_stride;
  for (int64_t pos = lo; pos < hi;) {
    const int64_t off = pos % s.block_size;
    const int64_t stop = std::min(hi, pos - off + s.block_size);
    const T* p = cache + table[pos / s.block_size] * block_stride + off * token_stride;
    for (; pos < stop; ++pos, p += token_stride) fn(pos, as_float(p, buf, token_stride));
  }
}

// Tokens [lo, hi) of one sequence, every head: scores, local softmax, weighted values.
template <typename T>
void attend_part(const float* qf, const T* k_cache, const T* v_cache, const int64_t* table, int64_t lo,
                 int64_t hi, const DecodeShape& s, float* scores, float* buf, Partial* parts, float* acc) {
  const int64_t groups = s.num_heads / s.num_kv_heads, hd = s.head_dim, nv = hd / W, n = hi - lo;
  // Pass 1: each key row (all KV heads, contiguous in the pool) against every query head.
  for_each_row(k_cache, table, lo, hi, s, buf, [&](int64_t pos, const float* row) {
    for (int64_t h = 0; h < s.num_heads; ++h) {
      const v8* qh = reinterpret_cast<const v8*>(qf + h * hd);
      const v8* k = reinterpret_cast<const v8*>(row + (h / groups) * hd);
      v8 dot = qh[0] * k[0];
      for (int64_t j = 1; j < nv; ++j) dot += qh[j] * k[j];
      scores[h * n + (pos - lo)] = hsum(dot);
    }
  });
  for (int64_t h = 0; h < s.num_heads; ++h) {
    float* sc = scores + h * n;
    const float mx = *std::max_element(sc, sc + n);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
    parts[h] = Partial{mx, sum};
  }
  // Pass 2: the probability-weighted sum of the value rows.
  std::fill(acc, acc + s.num_heads * hd, 0.f);
  for_each_row(v_cache, table, lo, hi, s, buf, [&](int64_t pos, const float* row) {
    for (int64_t h = 0; h < s.num_heads; ++h) {
      const float p = scores[h * n + (pos - lo)];
      const v8* v = reinterpret_cast<const v8*>(row + (h / groups) * hd);
      v8* a = reinterpret_cast<v8*>(acc + h * hd);
      for (int64_t j = 0; j < nv; ++j) a[j] += p * v[j];
    }
  });
}

// Work items are (sequence, part of its context): every item reads whole token rows, so the
// pool is read front to back within each block, and one long sequence still spreads over
// all threads. The parts of a sequence are then merged by their softmax state.
template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                      const int64_t* context_lens, T* out, const DecodeShape& s) {
  const int64_t hd = s.head_dim, heads = s.num_heads;
  std::vector<int64_t> first_item(s.num_seqs + 1, 0);
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    const int64_t len = context_lens[i];
    const int64_t n = len - (s.window > 0 ? std::max<int64_t>(0, len - s.window) : 0);
    first_item[i + 1] = first_item[i] + (n + kPartTokens - 1) / kPartTokens;
  }
  const int64_t num_items = first_item[s.num_seqs];
  std::vector<Partial> parts(num_items * heads);
  std::vector<float> accs(num_items * heads * hd);
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * hd), scores(heads * kPartTokens), buf(s.num_kv_heads * hd);
    int64_t seq = std::upper_bound(first_item.begin(), first_item.end(), begin) - first_item.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= first_item[seq + 1]) ++seq;
      const int64_t len = context_lens[seq];
      const int64_t first = s.window > 0 ? std::max<int64_t>(0, len - s.window) : 0;
      const int64_t lo = first + (item - first_item[seq]) * kPartTokens;
      const int64_t hi = std::min(len, lo + kPartTokens);
      const T* qs = q + seq * heads * hd;
      for (int64_t i = 0; i < heads * hd; ++i) qf[i] = static_cast<float>(qs[i]) * s.scale;
      attend_part(qf.data(), k_cache, v_cache, block_tables + seq * s.max_blocks, lo, hi, s, scores.data(),
                  buf.data(), parts.data() + item * heads, accs.data() + item * heads * hd);
    }
  });
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    for (int64_t h = 0; h < heads; ++h) {
      float mx = -INFINITY;
      for (int64_t it = first_item[seq]; it < first_item[seq + 1]; ++it) mx = std::max(mx, parts[it * heads + h].max);
      float sum = 0.f;
      std::vector<float> o(hd, 0.f);
      for (int64_t it = first_item[seq]; it < first_item[seq + 1]; ++it) {
        const float w = std::exp(parts[it * heads + h].max - mx);
        sum += w * parts[it * heads + h].sum;
        const float* a = accs.data() + (it * heads + h) * hd;
        for (int64_t i = 0; i < hd; ++i) o[i] += w * a[i];
      }
      T* os = out + (seq * heads + h) * hd;
      for (int64_t i = 0; i < hd; ++i) os[i] = static_cast<T>(o[i] / sum);
    }
  }
}

}  // namespace

// dtype: 0 float32, 1 bfloat16, 2 float16. Returns 0, or -1 for an unknown dtype.
extern "C" int splitserve_paged_decode_attention(
    int dtype, const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
    const int64_t* context_lens, void* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t max_blocks, int64_t window, float scale) {
  const DecodeShape s{num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, window, scale};
  switch (dtype) {
    case 0:
      decode_attention(static_cast<const float*>(q), static_cast<const float*>(k_cache),
                       static_cast<const float*>(v_cache), block_tables, context_lens,
                       static_cast<float*>(out), s);
      return 0;
    case 1:
      decode_attention(static_cast<const c10::BFloat16*>(q), static_cast<const c10::BFloat16*>(k_cache),
                       static_cast<const c10::BFloat16*>(v_cache), block_tables, context_lens,
                       static_cast<c10::BFloat16*>(out), s);
      return 0;
    case 2:
      decode_attention(static_cast<const c10::Half*>(q), static_cast<const c10::Half*>(k_cache),
                       static_cast<const c10::Half*>(v_cache), block_tables, context_lens,
                       static_cast<c10::Half*>(out), s);
      return 0;
    default:
      return -1;
  }
}
