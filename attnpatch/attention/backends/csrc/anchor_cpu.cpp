// AnchorAttention sparse prefill on the CPU: exact attention of each query block over its kept
// key stripes, with the gather fused into a flash-attention loop (online softmax, Dao et al. 2022,
// Alg. 1), so that no gathered copy of K/V and no [queries x kept keys] matrix is materialised.
//
// One work item is one (batch, query head, query block) group: the block's queries attend
//   * the keys strictly before the block's first query that the stripe mask keeps, gathered
//     `kv_tile` at a time into a per-thread buffer, then
//   * the block's own (diagonal) keys, causally, `kv_tile` at a time.
// Groups are handed to the threads one at a time (dynamic schedule: kept counts differ a lot
// between heads).  Key/value heads are shared by `H / Hkv` query heads and never repeated.
// Matrix products are single-threaded sgemm calls inside the parallel region.
//
// Also FNA's farthest-point sampling (farthest_point_sampling below): exact squared differences,
// one parallel pass over the tokens per landmark.
//
// Built on first use by attnpatch/attention/cpu_kernel.py; float32 only.
#include <omp.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

namespace {

using Vec = at::vec::Vectorized<float>;

// Row-major S[M x N] = alpha * A[M x K] . B[N x K]^T  (column-major: S^T = B . A^T).
inline void scores(int M, int N, int K, float alpha, const float* A, const float* B, float* S) {
  const char t = 'T', n = 'N';
  const float zero = 0.0f;
  sgemm_(&t, &n, &N, &M, &K, &alpha, B, &K, A, &K, &zero, S, &N);
}

// Row-major C[M x N] = P[M x K] . V[K x N] + beta * C  (column-major: C^T = V^T . P^T).
inline void accumulate(int M, int N, int K, const float* P, const float* V, float beta, float* C) {
  const char n = 'N';
  const float one = 1.0f;
  sgemm_(&n, &n, &N, &M, &K, &one, V, &N, P, &K, &beta, C, &N);
}

// Largest of si[0 .. n), n >= 1.
inline float row_max(const float* si, int n) {
  return at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, si, n);
}

// si[j] = exp(si[j] - m) for 0 <= j < n, in place; returns their sum (one row of an online softmax).
inline float exp_sum(float* si, int n, float m) {
  const Vec vm(m);
  Vec vsum(0.0f);
  int j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec x = (Vec::loadu(si + j) - vm).exp_u20();
    x.store(si + j);
    vsum = vsum + x;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
  for (; j < n; ++j) {
    si[j] = std::exp(si[j] - m);
    sum += si[j];
  }
  return sum;
}

// The shapes and layouts both entry points take (see stripe_attention).
void check_inputs(const char* fn, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& keep,
                  int64_t q_offset, int64_t block, int64_t kv_tile, int64_t q_tile) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && keep.scalar_type() == at::kBool,
              fn, ": float32 q, k and bool keep expected");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && keep.is_contiguous(), fn, ": contiguous inputs expected");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && keep.dim() == 4, fn, ": q, k, keep must be 4-d");
  TORCH_CHECK(block >= 1 && kv_tile >= 1 && q_tile >= 1, fn, ": block, kv_tile, q_tile must be >= 1");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == q.size(3) && k.size(1) >= 1 && H % k.size(1) == 0, fn, ": k does not fit q");
  TORCH_CHECK(keep.size(2) == (Lq + block - 1) / block && keep.size(0) == B && keep.size(1) == H && keep.size(3) == Lk,
              fn, ": keep does not fit q and k");
  TORCH_CHECK(q_offset >= 0 && q_offset + Lq <= Lk, fn, ": queries beyond the keys");
}

}  // namespace

// q:    [B, H, Lq, D] float32, contiguous; query row r is at absolute position q_offset + r.
// k, v: [B, Hkv, Lk, D] float32, contiguous; Lk >= q_offset + Lq.
// keep: [B, H, nb, Lk] bool, contiguous, nb = ceil(Lq / block): stripe mask; only keys before the
//       block's first query are read (the diagonal block is always attended, causally).
// scale: logit scale.  kv_tile: keys per step.  q_tile: query rows per step (a block longer than
// q_tile is processed q_tile rows at a time), so the per-thread buffers are q_tile x kv_tile scores
// plus kv_tile keys and values whatever the block size.
// Returns [B, H, Lq, D] float32.
torch::Tensor stripe_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& keep, int64_t q_offset, int64_t block, double scale,
                               int64_t kv_tile, int64_t q_tile) {
  check_inputs("stripe_attention", q, k, keep, q_offset, block, kv_tile, q_tile);
  TORCH_CHECK(v.scalar_type() == at::kFloat && v.is_contiguous() && v.sizes() == k.sizes(),
              "stripe_attention: v must be float32, contiguous and shaped like k");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), nb = keep.size(2);
  const int64_t G = H / Hkv, n_groups = B * H * nb;
  auto out = torch::empty_like(q);
  if (n_groups == 0 || D == 0) return out;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* keepp = keep.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int KT = static_cast<int>(kv_tile), DI = static_cast<int>(D);
  const int QT = static_cast<int>(std::min(q_tile, block));
  const float sc = static_cast<float>(scale);
  const float NEG = -std::numeric_limits<float>::infinity();
  const int nth = at::get_num_threads();

#pragma omp parallel num_threads(nth)
  {
    std::vector<float> kb(static_cast<size_t>(KT) * D), vb(static_cast<size_t>(KT) * D);
    std::vector<float> s(static_cast<size_t>(QT) * KT), m(QT), l(QT);
    std::vector<int64_t> idx(Lk);
#pragma omp for schedule(dynamic, 1)
    for (int64_t grp = 0; grp < n_groups; ++grp) {
      const int64_t bi = grp / (H * nb), hi = (grp / nb) % H, blk = grp % nb;
      const int64_t row0 = blk * block;                        // the block's first query row
      const int64_t nrows = std::min(block, Lq - row0);        // its query rows
      const int64_t p0 = q_offset + row0;                      // absolute position of its first query
      const float* kh = kp + (bi * Hkv + hi / G) * Lk * D;
      const float* vh = vp + (bi * Hkv + hi / G) * Lk * D;
      // kept keys strictly before the block
      const bool* kr = keepp + grp * Lk;
      int64_t cnt = 0;
      for (int64_t j = 0; j < p0; ++j) {
        if (kr[j]) idx[cnt++] = j;
      }
      for (int64_t r0 = 0; r0 < nrows; r0 += QT) {
        const int nq = static_cast<int>(std::min<int64_t>(QT, nrows - r0));
        const float* qg = qp + ((bi * H + hi) * Lq + row0 + r0) * D;
        float* acc = op + ((bi * H + hi) * Lq + row0 + r0) * D;
        std::fill(m.begin(), m.begin() + nq, NEG);
        std::fill(l.begin(), l.begin() + nq, 0.0f);
        std::fill(acc, acc + static_cast<size_t>(nq) * D, 0.0f);
        // one tile of n keys; row i (0 <= i < nq) sees its first visible(i) of them
        auto step = [&](int n, const float* kt, const float* vt, auto visible) {
          scores(nq, n, DI, sc, qg, kt, s.data());
          for (int i = 0; i < nq; ++i) {
            float* si = s.data() + static_cast<size_t>(i) * n;
            const int nn = visible(i);
            if (nn <= 0) {
              std::fill(si, si + n, 0.0f);
              continue;
            }
            const float mnew = std::max(m[i], row_max(si, nn));
            const float sum = exp_sum(si, nn, mnew);
            std::fill(si + nn, si + n, 0.0f);  // causally masked
            if (m[i] != NEG && m[i] != mnew) {  // rescale what earlier tiles accumulated
              const float a = std::exp(m[i] - mnew);
              l[i] *= a;
              float* ai = acc + static_cast<size_t>(i) * D;
              at::vec::map([a](Vec x) { return x * Vec(a); }, ai, ai, D);
            }
            l[i] += sum;
            m[i] = mnew;
          }
          accumulate(nq, DI, n, s.data(), vt, 1.0f, acc);
        };
        for (int64_t j0 = 0; j0 < cnt; j0 += KT) {  // gathered keys before the block: every row sees all
          const int n = static_cast<int>(std::min<int64_t>(KT, cnt - j0));
          for (int jj = 0; jj < n; ++jj) {
            std::memcpy(kb.data() + static_cast<size_t>(jj) * D, kh + idx[j0 + jj] * D, D * sizeof(float));
            std::memcpy(vb.data() + static_cast<size_t>(jj) * D, vh + idx[j0 + jj] * D, D * sizeof(float));
          }
          step(n, kb.data(), vb.data(), [n](int) { return n; });
        }
        // the diagonal block: row r0 + i sees block keys 0 .. r0 + i (contiguous, not gathered)
        for (int64_t c0 = 0; c0 < r0 + nq; c0 += KT) {
          const int n = static_cast<int>(std::min<int64_t>(KT, r0 + nq - c0));
          step(n, kh + (p0 + c0) * D, vh + (p0 + c0) * D, [n, r0, c0](int i) {
            return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(n, r0 + i + 1 - c0)));
          });
        }
        for (int i = 0; i < nq; ++i) {
          const float inv = l[i] > 0 ? 1.0f / l[i] : 0.0f;
          float* ai = acc + static_cast<size_t>(i) * D;
          at::vec::map([inv](Vec x) { return x * Vec(inv); }, ai, ai, D);
        }
      }
    }
  }
  return out;
}

// Exact softmax mass that each query's kept keys carry, for the query blocks listed in `blocks`
// (AnchorAttention's recall guard): one pass over every causal key, `kv_tile` contiguous keys at a
// time, keeping per query the running maximum logit, the sum of exp over all causal keys and the
// sum over the kept ones (keep[b, h, block, j], which holds the initial block and the window).
// q, k, keep, q_offset, block, scale as for stripe_attention; blocks: int64 [P] block indices.
// Returns [B, H, P * block] float64: the mass of row r of the p-th listed block at p * block + r;
// rows past the prompt get 0.
torch::Tensor kept_mass(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& keep,
                        const torch::Tensor& blocks, int64_t q_offset, int64_t block, double scale,
                        int64_t kv_tile, int64_t q_tile) {
  check_inputs("kept_mass", q, k, keep, q_offset, block, kv_tile, q_tile);
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.is_contiguous() && blocks.dim() == 1,
              "kept_mass: blocks must be a contiguous int64 vector");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), nb = keep.size(2), P = blocks.size(0);
  const int64_t* bp = blocks.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) TORCH_CHECK(bp[p] >= 0 && bp[p] < nb, "kept_mass: block index out of range");
  auto out = torch::zeros({B, H, P * block}, q.options().dtype(at::kDouble));
  const int64_t G = H / Hkv, n_groups = B * H * P;
  if (n_groups == 0 || D == 0) return out;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const bool* keepp = keep.data_ptr<bool>();
  double* op = out.data_ptr<double>();
  const int KT = static_cast<int>(kv_tile), DI = static_cast<int>(D);
  const int QT = static_cast<int>(std::min(q_tile, block));
  const float sc = static_cast<float>(scale);
  const float NEG = -std::numeric_limits<float>::infinity();
  const int nth = at::get_num_threads();

#pragma omp parallel num_threads(nth)
  {
    std::vector<float> s(static_cast<size_t>(QT) * KT), m(QT), la(QT), lk(QT);
#pragma omp for schedule(dynamic, 1)
    for (int64_t grp = 0; grp < n_groups; ++grp) {
      const int64_t bi = grp / (H * P), hi = (grp / P) % H, pi = grp % P, blk = bp[pi];
      const int64_t row0 = blk * block, nrows = std::min(block, Lq - row0), p0 = q_offset + row0;
      const float* kh = kp + (bi * Hkv + hi / G) * Lk * D;
      const bool* kr = keepp + ((bi * H + hi) * nb + blk) * Lk;
      for (int64_t r0 = 0; r0 < nrows; r0 += QT) {
        const int nq = static_cast<int>(std::min<int64_t>(QT, nrows - r0));
        const float* qg = qp + ((bi * H + hi) * Lq + row0 + r0) * D;
        std::fill(m.begin(), m.begin() + nq, NEG);
        std::fill(la.begin(), la.begin() + nq, 0.0f);
        std::fill(lk.begin(), lk.begin() + nq, 0.0f);
        const int64_t end = p0 + r0 + nq;  // keys at or after this are causal for no row
        for (int64_t j0 = 0; j0 < end; j0 += KT) {
          const int n = static_cast<int>(std::min<int64_t>(KT, end - j0));
          scores(nq, n, DI, sc, qg, kh + j0 * D, s.data());
          for (int i = 0; i < nq; ++i) {
            const int nn = static_cast<int>(std::min<int64_t>(n, p0 + r0 + i + 1 - j0));  // causal keys of the tile
            if (nn <= 0) continue;
            float* si = s.data() + static_cast<size_t>(i) * n;
            const float mnew = std::max(m[i], row_max(si, nn));
            if (m[i] != NEG && m[i] != mnew) {
              const float a = std::exp(m[i] - mnew);
              la[i] *= a;
              lk[i] *= a;
            }
            m[i] = mnew;
            la[i] += exp_sum(si, nn, mnew);
            const bool* kt = kr + j0;
            float sk = 0.0f;
            for (int jj = 0; jj < nn; ++jj) sk += kt[jj] ? si[jj] : 0.0f;
            lk[i] += sk;
          }
        }
        double* o = op + (bi * H + hi) * P * block + pi * block + r0;
        for (int i = 0; i < nq; ++i) o[i] = la[i] > 0 ? static_cast<double>(lk[i]) / la[i] : 0.0;
      }
    }
  }
  return out;
}

// Stripe selection, AnchorAttention Eq. 2-4 (arXiv 2505.23520), in one parallel region.
// q: [B, H, Lq, D] float32, contiguous, unscaled; query row r at absolute position q_offset + r.
// k: [B, Hkv, Lk, D] float32, contiguous.  key_valid: [B, Lk] bool.  start: int64 [B], each
// sequence's first valid key.  block: queries per block; stride: queries per pool (divides block);
// init_block, local_window: the always-kept keys; theta: finite stripe threshold; scale: logit scale.
// Returns keep [B, H, nb, Lk] bool, nb = ceil(Lq / block):
//   anchor(i)   = max of (q_i * scale) . k_j over valid keys j <= i of the initial block
//                 [start, start + init_block) and the window [end - local_window, end) of i's block
//                 (end: one past the block's last query);
//   pool p      : q_bar, a_bar = means over the pool's valid queries (a pool without one keeps nothing);
//   keep[n, j]  = (max_p  q_bar_p . k_j - (a_bar_p - theta) >= 0  or  j in the initial block or
//                 the window)  and  j < end  and  key_valid[j].
// Phase 1 (one item per (b, h, block)): anchors and pools.  Phase 2 (one item per (b, h, chunk of
// about `rows` pooled queries, tile of `kv_tile` keys)): single-threaded sgemm, threshold, store.
// Items are handed out dynamically and no ATen operator runs in between, so a busy machine costs
// what its CPU share costs, not a stall per small operator.
torch::Tensor stripe_select(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& key_valid,
                            const torch::Tensor& start, int64_t q_offset, int64_t block, int64_t stride,
                            int64_t init_block, int64_t local_window, double theta, double scale, int64_t rows,
                            int64_t kv_tile) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && key_valid.scalar_type() == at::kBool &&
                  start.scalar_type() == at::kLong,
              "stripe_select: float32 q, k, bool key_valid and int64 start expected");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && key_valid.is_contiguous() && start.is_contiguous(),
              "stripe_select: contiguous inputs expected");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && key_valid.dim() == 2 && start.dim() == 1, "stripe_select: bad ranks");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Hkv = k.size(1), Lk = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && Hkv >= 1 && H % Hkv == 0, "stripe_select: k does not fit q");
  TORCH_CHECK(key_valid.size(0) == B && key_valid.size(1) == Lk && start.size(0) == B,
              "stripe_select: key_valid or start does not fit k");
  TORCH_CHECK(block >= 1 && stride >= 1 && block % stride == 0 && init_block >= 0 && local_window >= 0 && rows >= 1 &&
                  kv_tile >= 1 && std::isfinite(theta),
              "stripe_select: bad block, stride, init_block, local_window, rows, kv_tile or theta");
  TORCH_CHECK(q_offset >= 0 && q_offset + Lq <= Lk, "stripe_select: queries beyond the keys");
  const int64_t nb = (Lq + block - 1) / block, P = block / stride, G = H / Hkv;
  auto keep = torch::zeros({B, H, nb, Lk}, k.options().dtype(at::kBool));
  if (B == 0 || H == 0 || nb == 0 || D == 0) return keep;
  auto qbar_t = torch::empty({B, H, nb, P, D}, q.options());
  auto thr_t = torch::empty({B, H, nb, P}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const bool* vp = key_valid.data_ptr<bool>();
  const int64_t* sp = start.data_ptr<int64_t>();
  float* qb = qbar_t.data_ptr<float>();
  float* tp = thr_t.data_ptr<float>();
  bool* out = keep.data_ptr<bool>();
  const float sc = static_cast<float>(scale), th = static_cast<float>(theta);
  const float NEG = -std::numeric_limits<float>::infinity(), POS = std::numeric_limits<float>::infinity();
  const int64_t n_init = std::min(init_block, Lk), n_win = std::min(local_window, Lk);
  auto block_end = [&](int64_t n) { return q_offset + std::min((n + 1) * block, Lq); };
  // phase 2's (chunk of blocks, key tile) pairs that hold at least one causal key
  const int64_t NC = std::max<int64_t>(1, rows / P);
  const int KT = static_cast<int>(kv_tile), DI = static_cast<int>(D);
  std::vector<std::pair<int64_t, int64_t>> pairs;
  for (int64_t c0 = 0; c0 < nb; c0 += NC) {
    const int64_t lc = block_end(std::min(nb, c0 + NC) - 1);
    for (int64_t j0 = 0; j0 < lc; j0 += KT) pairs.emplace_back(c0, j0);
  }
  const int64_t n_pairs = static_cast<int64_t>(pairs.size());
  const int nth = at::get_num_threads();

#pragma omp parallel num_threads(nth)
  {
    std::vector<float> qs(static_cast<size_t>(block) * D), an(block);
    std::vector<float> s(static_cast<size_t>(block) * std::max<int64_t>(std::max<int64_t>(n_init, n_win), 1));
    // phase 1: anchors (Eq. 2) and pooled queries and thresholds (Eq. 3)
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * H * nb; ++item) {
      const int64_t bi = item / (H * nb), hi = (item / nb) % H, blk = item % nb;
      const int64_t r0 = blk * block, nr = std::min(block, Lq - r0), end = block_end(blk);
      const bool* kv = vp + bi * Lk;
      const float* kh = kp + (bi * Hkv + hi / G) * Lk * D;
      const float* qr = qp + ((bi * H + hi) * Lq + r0) * D;
      for (int64_t i = 0; i < nr * D; ++i) qs[i] = qr[i] * sc;
      std::fill(an.begin(), an.begin() + nr, NEG);
      // candidate keys: [j0, j0 + n) clipped to the keys, masked per row (j <= position, valid)
      auto candidates = [&](int64_t j0, int64_t n) {
        const int64_t a = std::max<int64_t>(j0, 0), e = std::min<int64_t>(j0 + n, Lk);
        if (e <= a) return;
        const int m = static_cast<int>(e - a);
        scores(static_cast<int>(nr), m, DI, 1.0f, qs.data(), kh + a * D, s.data());
        for (int64_t i = 0; i < nr; ++i) {
          const int64_t pos = q_offset + r0 + i;
          const float* si = s.data() + i * m;
          float best = an[i];
          for (int jj = 0; jj < m; ++jj) {
            const int64_t j = a + jj;
            if (j <= pos && kv[j] && si[jj] > best) best = si[jj];
          }
          an[i] = best;
        }
      };
      candidates(sp[bi], n_init);
      candidates(end - n_win, n_win);
      float* qbo = qb + item * P * D;
      float* to = tp + item * P;
      for (int64_t p = 0; p < P; ++p) {
        float* qbp = qbo + p * D;
        std::fill(qbp, qbp + D, 0.0f);
        float cnt = 0.0f, asum = 0.0f;
        for (int64_t t = 0; t < stride; ++t) {
          const int64_t i = p * stride + t;
          if (i >= nr || !kv[q_offset + r0 + i]) continue;
          cnt += 1.0f;
          asum += an[i];
          const float* qi = qs.data() + i * D;
          for (int64_t dd = 0; dd < D; ++dd) qbp[dd] += qi[dd];
        }
        if (cnt > 0.0f) {
          for (int64_t dd = 0; dd < D; ++dd) qbp[dd] /= cnt;
          to[p] = asum / cnt - th;
        } else {
          to[p] = POS;  // a pool of padding keeps nothing
        }
      }
    }
    // phase 2: pooled queries against the causal keys, threshold (Eq. 4), always-kept keys, causal mask
    std::vector<float> s2(static_cast<size_t>(NC * P) * KT), best(KT);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * H * n_pairs; ++item) {
      const int64_t bh = item / n_pairs, bi = bh / H, hi = bh % H;
      const int64_t c0 = pairs[item % n_pairs].first, j0 = pairs[item % n_pairs].second;
      const int64_t nc = std::min(NC, nb - c0);
      const int n = static_cast<int>(std::min<int64_t>(KT, Lk - j0));
      scores(static_cast<int>(nc * P), n, DI, 1.0f, qb + (bh * nb + c0) * P * D, kp + ((bi * Hkv + hi / G) * Lk + j0) * D,
             s2.data());
      const bool* kv = vp + bi * Lk;
      for (int64_t bn = 0; bn < nc; ++bn) {
        const int64_t blk = c0 + bn, end = block_end(blk);
        const int nn = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(n, end - j0)));
        if (nn == 0) continue;
        const float* tb = tp + (bh * nb + blk) * P;
        std::fill(best.begin(), best.begin() + nn, NEG);
        for (int64_t p = 0; p < P; ++p) {
          const float* sp2 = s2.data() + static_cast<size_t>(bn * P + p) * n;
          const Vec vt(tb[p]);
          int j = 0;
          for (; j + Vec::size() <= nn; j += Vec::size())
            at::vec::maximum(Vec::loadu(sp2 + j) - vt, Vec::loadu(best.data() + j)).store(best.data() + j);
          for (; j < nn; ++j) best[j] = std::max(best[j], sp2[j] - tb[p]);
        }
        bool* o = out + (bh * nb + blk) * Lk + j0;
        const int64_t i0 = sp[bi], i1 = sp[bi] + init_block, w0 = end - local_window;
        for (int jj = 0; jj < nn; ++jj) {
          const int64_t j = j0 + jj;
          o[jj] = kv[j] && (best[jj] >= 0.0f || (j >= i0 && j < i1) || j >= w0);
        }
      }
    }
  }
  return keep;
}

namespace {

// |a - b|^2 over d floats: exact squared differences (0 for equal vectors, never negative), float32 sums.
inline float squared_distance(const float* a, const float* b, int64_t d) {
  Vec acc(0.0f);
  int64_t k = 0;
  for (; k + Vec::size() <= d; k += Vec::size()) {
    const Vec diff = Vec::loadu(a + k) - Vec::loadu(b + k);
    acc = at::vec::fmadd(diff, diff, acc);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; k < d; ++k) {
    const float diff = a[k] - b[k];
    sum += diff * diff;
  }
  return sum;
}

}  // namespace

// Farthest-point sampling (Gonzalez 1985; FNA's landmarks, arXiv 2507.16018, Sec. 3).
// x: [B, N, D] float32, contiguous.  Returns int64 [B, s]: tokens 0 .. first - 1, then s - first times the
// token whose squared distance to the nearest taken token is largest, ties to the lowest index.
// Distances are exact squared differences in float32 (as attnpatch/attention/landmarks/fps_triton.py computes
// them): a copy of a taken token is at distance exactly 0.  Per item, one parallel region; per step one pass
// over the tokens that updates each token's running minimum and finds the farthest, then a reduction over
// the threads' candidates (largest distance, then lowest index).
torch::Tensor farthest_point_sampling(const torch::Tensor& x, int64_t s, int64_t first) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3,
              "farthest_point_sampling: contiguous float32 [B, N, D] expected");
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2);
  TORCH_CHECK(first >= 1 && first <= s && s <= N, "farthest_point_sampling: needs 1 <= first <= s <= N");
  auto idx = torch::empty({B, s}, x.options().dtype(at::kLong));
  int64_t* ip = idx.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const int nth = std::max(1, at::get_num_threads());
  std::vector<float> dist(static_cast<size_t>(N));
  std::vector<float> cand_v(nth);
  std::vector<int64_t> cand_i(nth);
  for (int64_t b = 0; b < B; ++b) {
    const float* xb = xp + b * N * D;
    int64_t* out = ip + b * s;
    for (int64_t j = 0; j < first; ++j) out[j] = j;
    if (s == first) continue;
    std::fill(dist.begin(), dist.end(), std::numeric_limits<float>::infinity());
#pragma omp parallel num_threads(nth)
    {
      const int tid = omp_get_thread_num();
      // pass t: the centre out[t] (a prefix token, or the previous step's pick); the last pick needs none
      for (int64_t t = 0; t + 1 < s; ++t) {
        const float* c = xb + out[t] * D;
        float bv = -1.0f;
        int64_t bi = -1;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < N; ++i) {
          const float m = i < first ? -1.0f : std::min(dist[i], squared_distance(xb + i * D, c, D));
          dist[i] = m;
          if (m > bv) {  // indices rise within a thread's share: the first of equal distances stays
            bv = m;
            bi = i;
          }
        }
        cand_v[tid] = bv;
        cand_i[tid] = bi;
#pragma omp barrier
#pragma omp single
        {
          if (t + 1 >= first) {  // the next centre is the farthest token (else the next prefix token)
            float best_v = -1.0f;
            int64_t best_i = -1;
            for (int th = 0; th < omp_get_num_threads(); ++th) {
              if (cand_i[th] < 0) continue;
              if (cand_v[th] > best_v || (cand_v[th] == best_v && cand_i[th] < best_i)) {
                best_v = cand_v[th];
                best_i = cand_i[th];
              }
            }
            out[t + 1] = best_i;  // >= 0: an untaken token (distance >= 0) remains while t + 1 < s <= N
            dist[best_i] = -1.0f;  // taken: min(-1, d) stays -1
          }
        }  // implicit barrier: every thread sees out[t + 1]
      }
    }
  }
  return idx;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("farthest_point_sampling", &farthest_point_sampling, "farthest-point sampling, exact distances (float32, CPU)");
  m.def("stripe_attention", &stripe_attention, "AnchorAttention stripe attention (float32, CPU)");
  m.def("stripe_select", &stripe_select, "AnchorAttention stripe selection (float32, CPU)");
  m.def("kept_mass", &kept_mass, "softmax mass on the kept keys of some query blocks (float32, CPU)");
}
