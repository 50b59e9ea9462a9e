"""Attention of a few queries over a KV cache on CUDA as one plain kernel launch, without cuDNN.

Why: MLX's CUDA backend runs `mx.fast.scaled_dot_product_attention` with an array mask and more
than one query (a DFlash verify: 16 tokens a row; the draft's block) through cuDNN's SDPA: per
call it looks up an execution plan, populates a CUDA graph through cuDNN's frontend and adds it to
MLX's graph as a child graph (mlx/backend/cuda/scaled_dot_product_attention.cpp). On the lent
H200 a 1.5B target's verify is bound by the host's time per graph node (docs/benchmarks.md,
"Small matmuls in one kernel"); `worker.small_gemm` took the cuBLAS calls out of it, this takes
the 28 attention calls (plus the draft's).

`small_attention(q, k, v, scale, mask)` is one JIT-compiled kernel (`mx.fast.cuda_kernel`) that
MLX launches as an ordinary kernel node. One block of 256 threads per (row, KV head, query):
it computes the query's scores for every query head sharing that KV head (grouped-query
attention: K and V are read once for the group), in chunks of keys with the online softmax of
Milakov & Gimelshein 2018 ("Online normalizer calculation for softmax"; as FlashAttention,
Dao et al. 2022), all in fp32, and writes the output in (B, L, H, D) order, so that the model's
transpose back to (B, L, H * D) is free. No tensor cores: at 16-64 queries and the contexts a
worker's sessions reach the kernel is bound by reading K and V, which it reads once per
(row, KV head, query) from L2.

Measured on the H200 (docs/benchmarks.md, "Attention in one kernel"): as exact as MLX's own
against a float32 reference; 8-36 us less host time a call; after the P.V step kept eight V rows
in flight a thread, calls finish as soon as cuDNN's up to about 1,000 keys (slower at 4,112), and
a 16-token verify of the 1.5B target took 14% less time than with `small_gemm` alone (the first
version, slower on the device, had made it 10% longer on a fast-host machine). On by default
(`EngineConfig.small_attention`).

Long contexts (`n_splits` > 1): one block reads its keys one after another, so a verify's 32
blocks leave most of the GPU idle at thousands of keys; split, each block scores a range of the
keys and writes its unnormalised output, running max and denominator in fp32, and a second
kernel merges the splits (flash-decoding: Dao et al. 2023). `splits` proposes how many; the
worker's path uses it only with SPLIT_LONG_CONTEXTS (off until timed; on the H200 so far as
exact as MLX's own in the benchmark's error table, its tests with empty splits not yet run there).

`patched_sdpa()` is a context manager that routes `mx.fast.scaled_dot_product_attention` to
`attention` (this kernel where it `applies`, MLX's own otherwise) while a compiled forward is
traced or run, so mlx-lm's models use it without a line of their code copied.
"""
from __future__ import annotations

import contextlib
import hashlib
import struct
from typing import Optional

import mlx.core as mx

from worker.small_gemm import cuda_sm80

THREADS = 256
MAX_GROUP = 16  # query heads per KV head the kernel takes (shared memory: G x CHUNK scores)
SCORE_FLOATS = 8192  # fp32 scores a block keeps in shared memory (32 KiB): CHUNK = this / G
HEAD_DIMS = (64, 128, 256)  # P.V: D / 8 threads a V row must divide a warp or fill it
MAX_QUERIES = 64  # a block per query: longer calls (prefill) keep cuDNN's flash kernels
# Long contexts: a block's keys are read one after another, so with few blocks (a verify: 32) a
# long context leaves most SMs idle; from 2 x SPLIT_KEYS keys on, the keys are split over blocks
# (at least SPLIT_KEYS each) up to SPLIT_BLOCKS blocks in all, and a second kernel merges them.
SPLIT_KEYS = 512
SPLIT_BLOCKS = 132  # one wave: an H200's 132 SMs, one block each (~170 registers a thread)
# Whether `attention` (the worker's path) splits long contexts' keys: off until the split is
# timed on the GPU (docs/benchmarks.md, "The 2.5x goal across processes; attention at long
# contexts").
SPLIT_LONG_CONTEXTS = False

_HEADER = r"""
#define SA_NEG_INF __int_as_float(0xff800000)
// 8 consecutive elements (stride sd) at p as floats: one 16-byte load where allowed.
template <typename T>
__device__ __forceinline__ void small_attn_load8(const T* p, long long sd, bool vec, float* f) {
  if (vec) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* h = reinterpret_cast<const T*>(&u);
    #pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(h[i]);
  } else {
    #pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i * sd]);
  }
}
// Every thread of the block gets the block-wide max (or sum) of v[0..G-1].
template <int G, bool MAX>
__device__ __forceinline__ void small_attn_reduce(float* v, float (*red)[G], int lane, int warp) {
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float o = __shfl_xor_sync(0xffffffffu, v[g], off);
      v[g] = MAX ? fmaxf(v[g], o) : v[g] + o;
    }
  }
  if (lane == 0) {
    #pragma unroll
    for (int g = 0; g < G; ++g) red[warp][g] = v[g];
  }
  __syncthreads();
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    float r = red[0][g];
    #pragma unroll
    for (int w = 1; w < 8; ++w) r = MAX ? fmaxf(r, red[w][g]) : r + red[w][g];
    v[g] = r;
  }
  __syncthreads();
}
"""

# The body (MLX writes the signature: q, k, v[, mask] then y, or po and pm when the keys are
# split, with shapes and strides as used). Template constants: T (dtype), D (head dim), G (query
# heads per KV head), C (keys a chunk), NS (key splits), SCALE_BITS (the softmax scale's float
# bits). Block = (row b, KV head hk, query l, key split sp): split sp scores keys
# [sp * ceil(S / NS), ...) of S.
_SOURCE = r"""
  const int L = q_shape[2], HKV = k_shape[1], S = k_shape[2];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sp = blockIdx.x % NS, blk = blockIdx.x / NS;
  const int l = blk % L, hk = (blk / L) % HKV, b = blk / (L * HKV);
  const int per = (S + NS - 1) / NS, k_lo = min(S, sp * per), k_hi = min(S, k_lo + per);
  constexpr int TPR = D / 8;  // P.V: threads a V row (8 dims each: one 16-byte load)
  constexpr int NKG = 256 / TPR;  // P.V: key groups, each thread's keys kg, kg + NKG, ...
  constexpr int UNROLL = 8;  // P.V: V rows a thread has in flight (the loop waits on loads)
  __shared__ float qs[G][D];
  __shared__ float sc[G][C];
  __shared__ float red[8][G];
  const float scale = __int_as_float(SCALE_BITS);
  for (int i = tid; i < G * D; i += 256) {
    const int g = i / D, d = i % D;
    qs[g][d] = static_cast<float>(q[b * q_strides[0] + (hk * G + g) * q_strides[1] + l * q_strides[2]
                                    + d * q_strides[3]]) * scale;
  }
  const T* kb = k + b * k_strides[0] + hk * k_strides[1];
  const T* vb = v + b * v_strides[0] + hk * v_strides[1];
  const bool k_vec = k_strides[3] == 1 && (k_strides[2] & 7) == 0 && (reinterpret_cast<size_t>(kb) & 15) == 0;
  const bool v_vec = v_strides[3] == 1 && (v_strides[2] & 7) == 0 && (reinterpret_cast<size_t>(vb) & 15) == 0;
  const int ds = tid % TPR, kg = tid / TPR;
  float m_run[G], l_run[G], acc[G][8];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    m_run[g] = SA_NEG_INF; l_run[g] = 0.f;
    #pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
  }
  __syncthreads();
  for (int c0 = k_lo; c0 < k_hi; c0 += C) {
    const int n = min(C, k_hi - c0);
    float cm[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) cm[g] = SA_NEG_INF;
    for (int jj = tid; jj < n; jj += 256) {
      const T* kp = kb + (long long)(c0 + jj) * k_strides[2];
      float s[G];
      #pragma unroll
      for (int g = 0; g < G; ++g) s[g] = 0.f;
      #pragma unroll 4
      for (int d0 = 0; d0 < D; d0 += 8) {
        float kf[8];
        small_attn_load8(kp + d0 * k_strides[3], k_strides[3], k_vec, kf);
        #pragma unroll
        for (int g = 0; g < G; ++g) {
          #pragma unroll
          for (int i = 0; i < 8; ++i) s[g] += qs[g][d0 + i] * kf[i];
        }
      }
      #pragma unroll
      for (int g = 0; g < G; ++g) {
        const float x = s[g] + MASK_AT(g, c0 + jj);
        sc[g][jj] = x;
        cm[g] = fmaxf(cm[g], x);
      }
    }
    small_attn_reduce<G, true>(cm, red, lane, warp);
    float corr[G], cs[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      const float m_new = fmaxf(m_run[g], cm[g]);
      corr[g] = m_run[g] == SA_NEG_INF ? 0.f : expf(m_run[g] - m_new);
      m_run[g] = m_new;
      cs[g] = 0.f;
    }
    for (int jj = tid; jj < n; jj += 256) {
      #pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = m_run[g] == SA_NEG_INF ? 0.f : expf(sc[g][jj] - m_run[g]);
        sc[g][jj] = p;
        cs[g] += p;
      }
    }
    small_attn_reduce<G, false>(cs, red, lane, warp);  // its barrier also publishes sc
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      l_run[g] = l_run[g] * corr[g] + cs[g];
      #pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] *= corr[g];
    }
    const T* vrow = vb + ds * 8 * v_strides[3];
    int jj = kg;
    for (; jj + (UNROLL - 1) * NKG < n; jj += UNROLL * NKG) {
      float vf[UNROLL][8];
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u)
        small_attn_load8(vrow + (long long)(c0 + jj + u * NKG) * v_strides[2], v_strides[3], v_vec, vf[u]);
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        #pragma unroll
        for (int g = 0; g < G; ++g) {
          const float p = sc[g][jj + u * NKG];
          #pragma unroll
          for (int i = 0; i < 8; ++i) acc[g][i] += p * vf[u][i];
        }
      }
    }
    for (; jj < n; jj += NKG) {
      float vf[8];
      small_attn_load8(vrow + (long long)(c0 + jj) * v_strides[2], v_strides[3], v_vec, vf);
      #pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = sc[g][jj];
        #pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] += p * vf[i];
      }
    }
    __syncthreads();  // the next chunk overwrites sc
  }
  // Sum the key groups' partial outputs: within a warp by shuffles (its lanes hold 32 / TPR
  // groups), then the 8 warps' sums through sc (free now) in two rounds of at most 4 * G * D
  // floats (<= G * C): warps 4-7 into 0-3, then 1-3 into 0.
  #pragma unroll
  for (int off = TPR; off < 32; off <<= 1) {
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      #pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], off);
    }
  }
  float* part = &sc[0][0];
  if (warp >= 4 && lane < TPR) {
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      #pragma unroll
      for (int i = 0; i < 8; ++i) part[((warp - 4) * G + g) * D + ds * 8 + i] = acc[g][i];
    }
  }
  __syncthreads();
  if (warp < 4 && lane < TPR) {
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      #pragma unroll
      for (int i = 0; i < 8; ++i) acc[g][i] += part[(warp * G + g) * D + ds * 8 + i];
    }
  }
  __syncthreads();
  if (warp > 0 && warp < 4 && lane < TPR) {
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      #pragma unroll
      for (int i = 0; i < 8; ++i) part[((warp - 1) * G + g) * D + ds * 8 + i] = acc[g][i];
    }
  }
  __syncthreads();
  if (warp == 0 && lane < TPR) {
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      const long long r = ((long long)b * L + l) * (HKV * G) + hk * G + g;  // output row (b, l, h)
      WRITE_ROW
      #pragma unroll
      for (int i = 0; i < 8; ++i) {
        float o = acc[g][i];
        #pragma unroll
        for (int w = 0; w < 3; ++w) o += part[(w * G + g) * D + ds * 8 + i];
        WRITE_AT(i, o);
      }
    }
  }
"""

# One block (single split): the normalised output straight into y (B, L, H, D).
_WRITE_ONE = ("const float inv = l_run[g] > 0.f ? 1.f / l_run[g] : 0.f;\n"
              "      T* yp = y + r * D + ds * 8;", "yp[i] = static_cast<T>(o * inv)")
# Split keys: the split's unnormalised sum into po (B, L, H, NS, D) fp32, its running max and
# softmax denominator into pm (B, L, H, NS, 2) fp32; _COMBINE merges the splits.
_WRITE_SPLIT = ("float* op = po + (r * NS + sp) * D + ds * 8;\n"
                "      if (ds == 0) { pm[(r * NS + sp) * 2] = m_run[g]; pm[(r * NS + sp) * 2 + 1] = l_run[g]; }",
                "op[i] = o")

# Flash-decoding's merge (Dao et al. 2023, "Flash-Decoding for long-context inference"): a block
# of D threads per output row r = (b, l, h); weights exp(m_s - max m) rescale each split's sum
# and denominator; a row no split saw a key of gets zeros, as with one block.
_COMBINE = r"""
  const long long r = blockIdx.x;
  const int d = threadIdx.x;
  float m = SA_NEG_INF;
  for (int s = 0; s < NS; ++s) m = fmaxf(m, pm[(r * NS + s) * 2]);
  float num = 0.f, den = 0.f;
  if (m != SA_NEG_INF) {
    for (int s = 0; s < NS; ++s) {
      const float ms = pm[(r * NS + s) * 2];
      const float w = ms == SA_NEG_INF ? 0.f : expf(ms - m);
      num += w * po[(r * NS + s) * D + d];
      den += w * pm[(r * NS + s) * 2 + 1];
    }
  }
  y[r * D + d] = static_cast<T>(den > 0.f ? num / den : 0.f);
"""


def _source(masked: bool, split: bool) -> str:
    # The mask (broadcast to (B, H, L, S) by the caller, so strides say where each value is),
    # written out in the body: MLX passes `mask_strides` only if the body names it.
    at = ("static_cast<float>(mask[b * mask_strides[0] + (hk * G + g) * mask_strides[1] "
          "+ l * mask_strides[2] + (long long)(c0 + jj) * mask_strides[3]])" if masked else "0.f")
    row, write = _WRITE_SPLIT if split else _WRITE_ONE
    return (_SOURCE.replace("MASK_AT(g, c0 + jj)", at).replace("WRITE_ROW", row)
            .replace("WRITE_AT(i, o)", write))


_kernels: dict = {}


def _named_kernel(kind: str, source: str, **kwargs):
    # MLX caches compiled kernels on disk by name (and template values) only: the name carries
    # a digest of the code.
    digest = hashlib.sha256((_HEADER + source).encode()).hexdigest()[:12]
    return mx.fast.cuda_kernel(name=f"flashfleet_small_attention_{kind}_{digest}", source=source,
                               header=_HEADER, **kwargs)


def _kernel(masked: bool, split: bool):
    key = (masked, split)
    if key not in _kernels:
        kind = ("mask" if masked else "nomask") + ("_split" if split else "")
        _kernels[key] = _named_kernel(
            kind, _source(masked, split),
            input_names=["q", "k", "v", "mask"] if masked else ["q", "k", "v"],
            output_names=["po", "pm"] if split else ["y"], ensure_row_contiguous=False)
    return _kernels[key]


def _combine_kernel():
    if "combine" not in _kernels:
        _kernels["combine"] = _named_kernel("combine", _COMBINE, input_names=["po", "pm"],
                                            output_names=["y"], ensure_row_contiguous=True)
    return _kernels["combine"]


def available() -> bool:
    """Whether `small_attention` can run here: MLX's CUDA backend (any GPU MLX supports: no
    tensor-core instruction is used, but sm_80 or later is asked, as for `small_gemm`, so one
    check covers the worker's CUDA paths), not turned off with FLASHFLEET_SMALL_ATTENTION=0."""
    return cuda_sm80("FLASHFLEET_SMALL_ATTENTION")


def chunk(group: int) -> int:
    """Keys a block scores at a time for `group` query heads per KV head: as many as fit
    SCORE_FLOATS fp32 scores, a multiple of 32."""
    return SCORE_FLOATS // group // 32 * 32


def fits(group: int, head_dim: int) -> bool:
    """Whether a block's shared memory (the group's queries, a chunk of scores, the reductions)
    stays within the 48 KiB a kernel gets without asking, and the chunk can hold the key
    warps' partial outputs at the end."""
    c = chunk(group)
    return 4 * (group * head_dim + group * c + 8 * group) <= 48 * 1024 and 4 * head_dim <= c


def splits(blocks: int, keys: int) -> int:
    """Key splits for `blocks` (row, KV head, query) blocks over `keys` keys: 1 (one kernel)
    below 2 x SPLIT_KEYS keys; else the largest power of two that keeps blocks x splits within
    SPLIT_BLOCKS (one wave) and each split at least SPLIT_KEYS keys (powers of two: the split
    count is a template constant, so a growing context compiles a few kernels, not one per
    512 keys)."""
    if keys < 2 * SPLIT_KEYS:
        return 1
    n = max(1, min(keys // SPLIT_KEYS, SPLIT_BLOCKS // max(1, blocks)))
    return 1 << (n.bit_length() - 1)


def applies(q: mx.array, k: mx.array, v: mx.array, mask=None, sinks=None) -> bool:
    """Whether `small_attention(q, k, v, scale, mask)` handles these inputs (else MLX's own):
    q (B, H, L, D) with L <= MAX_QUERIES, k and v (B or 1, H_kv, S, D) of q's dtype (bf16 or fp16), H a multiple of
    H_kv with at most MAX_GROUP query heads per KV head, D in HEAD_DIMS, no attention sinks, and
    the mask None or an array of q's dtype (not "causal", not boolean) that broadcasts to
    (B, H, L, S)."""
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape or sinks is not None:
        return False
    if q.dtype not in (mx.bfloat16, mx.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    B, H, L, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if not 1 <= L <= MAX_QUERIES or B < 1 or Dk != D or D not in HEAD_DIMS or Bk not in (1, B) or H % Hkv or H // Hkv > MAX_GROUP or S < 1:
        return False
    if not fits(H // Hkv, D):
        return False
    if mask is None:
        return True
    # the mask's dtype is not part of the compiled kernel's name: q's only (as MLX asks too)
    if not isinstance(mask, mx.array) or mask.dtype != q.dtype:
        return False
    if mask.ndim > 4:
        return False
    target = (B, H, L, S)[4 - mask.ndim:]
    return all(m in (1, t) for m, t in zip(mask.shape, target))


def small_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                    mask: Optional[mx.array] = None, n_splits: int = 1) -> mx.array:
    """softmax(q k^T * scale + mask) v per head as one CUDA kernel (fp32 scores and sums), or at
    long contexts two: the keys split over blocks, then merged (flash-decoding).

    Args:
        q: (B, H, L, D) bf16 or fp16, any strides (a transposed projection as mlx-lm makes it).
        k, v: (B or 1, H_kv, S, D), q's dtype; query head h reads KV head h // (H / H_kv).
        scale: the scores' factor (usually D ** -0.5).
        mask: optional additive array broadcastable to (B, H, L, S) (0 to attend, -inf not to);
            a query that may attend to no key gets zeros.
        n_splits: key splits over blocks (1: one kernel, no merge; `splits(B * H_kv * L, S)`
            is the policy proposed for long contexts).

    Returns:
        (B, H, L, D) in q's dtype: a transposed view of a (B, L, H, D) array, so that
        `.transpose(0, 2, 1, 3).reshape(B, L, H * D)` needs no copy. Equal to MLX's
        `mx.fast.scaled_dot_product_attention` up to rounding (tests/test_small_attention.py).

    Raises:
        ValueError: inputs `applies` rejects, or n_splits < 1. (MLX raises if the default
            device is not a GPU.)
    """
    if not applies(q, k, v, mask):
        raise ValueError(f"small_attention: q {q.shape} {q.dtype}, k {k.shape}, v {v.shape}, mask "
                         f"{None if mask is None else (mask.shape, mask.dtype)} not taken (see `applies`)")
    B, H, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    ns = int(n_splits)
    if ns < 1:
        raise ValueError(f"small_attention: n_splits must be >= 1, got {n_splits}")
    inputs = [q, k, v]
    template = [("T", q.dtype), ("D", D), ("G", H // Hkv), ("C", chunk(H // Hkv)), ("NS", ns),
                ("SCALE_BITS", struct.unpack("<i", struct.pack("<f", float(scale)))[0])]
    if k.shape[0] != B:  # one cache for every row: the kernel reads row b at stride 0
        inputs = [q, mx.broadcast_to(k, (B, *k.shape[1:])), mx.broadcast_to(v, (B, *v.shape[1:]))]
    if mask is not None:
        inputs.append(mx.broadcast_to(mask, (B, H, L, S)))
    launch = dict(grid=(B * Hkv * L * ns * THREADS, 1, 1), threadgroup=(THREADS, 1, 1))
    if ns == 1:
        (y,) = _kernel(mask is not None, False)(inputs=inputs, template=template, output_shapes=[(B, L, H, D)],
                                                output_dtypes=[q.dtype], **launch)
    else:
        po, pm = _kernel(mask is not None, True)(inputs=inputs, template=template,
                                                 output_shapes=[(B, L, H, ns, D), (B, L, H, ns, 2)],
                                                 output_dtypes=[mx.float32, mx.float32], **launch)
        (y,) = _combine_kernel()(inputs=[po, pm], template=[("T", q.dtype), ("D", D), ("NS", ns)],
                                 grid=(B * L * H * D, 1, 1), threadgroup=(D, 1, 1),
                                 output_shapes=[(B, L, H, D)], output_dtypes=[q.dtype])
    return y.transpose(0, 2, 1, 3)


_mlx_sdpa = mx.fast.scaled_dot_product_attention


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None, sinks=None,
              **kwargs) -> mx.array:
    """`mx.fast.scaled_dot_product_attention`'s signature: `small_attention` where it `applies`
    and is `available` (keys split over blocks by `splits` only with SPLIT_LONG_CONTEXTS), MLX's
    own otherwise (CPU, Metal, float32, "causal" or boolean masks, sinks, shapes it does not
    take)."""
    if not kwargs and available() and applies(q, k, v, mask, sinks):
        n = splits(q.shape[0] * k.shape[1] * q.shape[2], k.shape[2]) if SPLIT_LONG_CONTEXTS else 1
        return small_attention(q, k, v, scale, mask, n_splits=n)
    return _mlx_sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)


@contextlib.contextmanager
def patched_sdpa(enabled: bool = True):
    """Within it, `mx.fast.scaled_dot_product_attention` is `attention` (for the code that looks
    it up at call time: mlx-lm's models, through `mlx_lm.models.base`). Used around compiled
    forwards: a trace records the kernel, later replays need no Python. Not thread-safe: the
    worker runs all MLX work on its engine thread. `enabled=False` changes nothing."""
    if not enabled:
        yield
        return
    saved = mx.fast.scaled_dot_product_attention
    mx.fast.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = saved


@contextlib.contextmanager
def split_long_contexts(on: bool = True):
    """Within it `attention` splits long contexts' keys (`splits`) or not, whatever
    SPLIT_LONG_CONTEXTS says outside it: for benchmarks that time both before the default
    changes. A compiled forward keeps what its trace saw. Not thread-safe (as `patched_sdpa`)."""
    global SPLIT_LONG_CONTEXTS
    saved, SPLIT_LONG_CONTEXTS = SPLIT_LONG_CONTEXTS, bool(on)
    try:
        yield
    finally:
        SPLIT_LONG_CONTEXTS = saved


_MARK = "_flashfleet_small_attention"


def use_small_attention(model, on: bool = True) -> bool:
    """Marks `model` (a target or a DFlash draft) so that its compiled forwards
    (`worker.compiled_forward.CompiledTarget`, `worker.compiled_draft.CompiledDraft`) trace and
    run under `patched_sdpa`; each keeps a separate trace for either state, so the mark can be
    changed between calls. Returns whether the mark is on (never where `available()` is False)."""
    on = bool(on) and available()
    object.__setattr__(model, _MARK, on)
    return on


def uses_small_attention(model) -> bool:
    """Whether `use_small_attention` marked this model on."""
    return bool(model.__dict__.get(_MARK, False))
