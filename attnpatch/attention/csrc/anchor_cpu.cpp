// AnchorAttention sparse prefill on the CPU: exact attention of each query block over its kept
// key stripes, with the gather fused into a flash-attention loop (online softmax, Dao et al. 2022,
// Alg. 1), so that no gathered copy of K/V and no [queries x kept keys] matrix is materialised.
//
// One work item is one (batch, query head, query block) group: the block's `block` queries attend
//   * the keys strictly before the block's first query that the stripe mask keeps, gathered
//     `kv_tile` at a time into a per-thread buffer, then
//   * the block's own (diagonal) keys, causally.
// Groups are handed to the threads one at a time (dynamic schedule: kept counts differ a lot
// between heads).  Key/value heads are shared by `H / Hkv` query heads and never repeated.
// Matrix products are single-threaded sgemm calls inside the parallel region.
//
// Built on first use by attnpatch/attention/cpu_kernel.py; float32 only.
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

}  // namespace

// q:    [B, H, nb * block, D] float32, contiguous (query rows past the prompt are padding).
// k, v: [B, Hkv, Lk, D] float32, contiguous.
// keep: [B, H, nb, Lk] bool, contiguous: stripe mask; only keys before the block's first query are read.
// q_offset: absolute position of query row 0.  scale: logit scale.  kv_tile: gathered keys per step.
// Returns [B, H, nb * block, D] float32.
torch::Tensor stripe_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& keep, int64_t q_offset, int64_t block, double scale,
                               int64_t kv_tile) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "stripe_attention: float32 q, k, v expected");
  TORCH_CHECK(keep.scalar_type() == at::kBool, "stripe_attention: bool keep expected");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && keep.is_contiguous(),
              "stripe_attention: contiguous inputs expected");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && keep.dim() == 4, "stripe_attention: bad ranks");
  const int64_t B = q.size(0), H = q.size(1), NQ = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), nb = keep.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && H % Hkv == 0, "stripe_attention: k shape does not fit q");
  TORCH_CHECK(NQ == nb * block && keep.size(0) == B && keep.size(1) == H && keep.size(3) == Lk,
              "stripe_attention: keep shape does not fit q and k");
  TORCH_CHECK(q_offset >= 0 && q_offset < Lk && kv_tile >= 1 && block >= 1, "stripe_attention: bad sizes");
  const int64_t G = H / Hkv, n_groups = B * H * nb;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* keepp = keep.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int KT = static_cast<int>(kv_tile), BQ = static_cast<int>(block), DI = static_cast<int>(D);
  const float sc = static_cast<float>(scale);
  const float NEG = -std::numeric_limits<float>::infinity();
  const int nth = at::get_num_threads();

#pragma omp parallel num_threads(nth)
  {
    std::vector<float> kb(static_cast<size_t>(KT) * D), vb(static_cast<size_t>(KT) * D);
    std::vector<float> s(static_cast<size_t>(BQ) * std::max(KT, BQ)), m(BQ), l(BQ);
    std::vector<int64_t> idx(Lk);
#pragma omp for schedule(dynamic, 1)
    for (int64_t grp = 0; grp < n_groups; ++grp) {
      const int64_t bi = grp / (H * nb), hi = (grp / nb) % H, blk = grp % nb;
      const int64_t p0 = q_offset + blk * block;  // absolute position of the block's first query
      const float* kh = kp + (bi * Hkv + hi / G) * Lk * D;
      const float* vh = vp + (bi * Hkv + hi / G) * Lk * D;
      const float* qg = qp + grp * block * D;
      float* acc = op + grp * block * D;
      // kept keys strictly before the block
      const bool* kr = keepp + grp * Lk;
      int64_t cnt = 0;
      const int64_t before = std::min(p0, Lk);
      for (int64_t j = 0; j < before; ++j) {
        if (kr[j]) idx[cnt++] = j;
      }
      const int64_t dl = std::min<int64_t>(block, Lk - p0);  // diagonal keys
      std::fill(m.begin(), m.end(), NEG);
      std::fill(l.begin(), l.end(), 0.0f);
      const int64_t ntile = (cnt + KT - 1) / KT;
      bool first = true;
      for (int64_t t = 0; t <= ntile; ++t) {
        const bool diag = (t == ntile);
        int n;
        const float* kt;
        const float* vt;
        if (diag) {
          n = static_cast<int>(dl);
          kt = kh + p0 * D;
          vt = vh + p0 * D;
        } else {
          const int64_t j0 = t * KT;
          n = static_cast<int>(std::min<int64_t>(KT, cnt - j0));
          for (int jj = 0; jj < n; ++jj) {
            std::memcpy(kb.data() + static_cast<size_t>(jj) * D, kh + idx[j0 + jj] * D, D * sizeof(float));
            std::memcpy(vb.data() + static_cast<size_t>(jj) * D, vh + idx[j0 + jj] * D, D * sizeof(float));
          }
          kt = kb.data();
          vt = vb.data();
        }
        scores(BQ, n, DI, sc, qg, kt, s.data());
        for (int i = 0; i < BQ; ++i) {
          float* si = s.data() + static_cast<size_t>(i) * n;
          // diagonal block: query i sees its block's keys 0..i
          const int nn = diag ? std::min(n, i + 1) : n;
          const float mx = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, si, nn);
          const float mnew = std::max(m[i], mx);
          const Vec vm(mnew);
          Vec vsum(0.0f);
          int jj = 0;
          for (; jj + Vec::size() <= nn; jj += Vec::size()) {
            const Vec x = (Vec::loadu(si + jj) - vm).exp_u20();
            x.store(si + jj);
            vsum = vsum + x;
          }
          float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vsum);
          for (; jj < nn; ++jj) {
            const float x = std::exp(si[jj] - mnew);
            si[jj] = x;
            sum += x;
          }
          for (; jj < n; ++jj) si[jj] = 0.0f;  // causally masked
          const float a = (m[i] == NEG) ? 0.0f : std::exp(m[i] - mnew);
          l[i] = l[i] * a + sum;
          m[i] = mnew;
          if (!first && a != 1.0f) {
            float* ai = acc + static_cast<size_t>(i) * D;
            at::vec::map([a](Vec x) { return x * Vec(a); }, ai, ai, D);
          }
        }
        accumulate(BQ, DI, n, s.data(), vt, first ? 0.0f : 1.0f, acc);
        first = false;
      }
      for (int i = 0; i < BQ; ++i) {
        const float inv = l[i] > 0 ? 1.0f / l[i] : 0.0f;
        float* ai = acc + static_cast<size_t>(i) * D;
        at::vec::map([inv](Vec x) { return x * Vec(inv); }, ai, ai, D);
      }
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stripe_attention", &stripe_attention, "AnchorAttention stripe attention (float32, CPU)");
}
