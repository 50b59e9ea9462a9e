"""Linear layers of a few rows on CUDA as one plain kernel launch, without cuBLAS's per-call host cost.

Why: on the H200 a 1.5B target's verify is bound by the host, not the GPU (a cycle's
`mx.async_eval` holds the host for most of it). MLX's CUDA
backend runs a matmul of one row as its own GEMV kernel (one graph node), but every matmul of
2 or more rows, and every biased one, through cuBLASLt: per call it builds the descriptors,
asks for a heuristic and records the call by stream capture into a child graph
(mlx/backend/cuda/gemms/cublas_gemm.cpp, matmul.cpp). A 16-token verify of a 28-layer target
makes 112 such calls (an unquantized DFlash draft 7 more a layer). With this module a 16-token
verify of the 1.5B target took 29% less time on two of three H200 machines, 4% on the third
(docs/benchmarks.md, "Small matmuls in one kernel").

`small_gemm(x, w, bias)` computes y = x @ w.T (+ bias) for x of at most `MAX_ROWS` rows with one
JIT-compiled kernel (`mx.fast.cuda_kernel`) that MLX launches as an ordinary kernel node: tensor
cores through `mma.sync.m16n8k16` (bf16 or fp16 in, fp32 accumulate, as cuBLAS; sm_80 or later),
weights streamed once with 16-byte loads (x too, where it is 16-byte aligned). Every block of 4
warps computes 8, 16 or 32 output columns (`n_tiles`); each warp takes every fourth 64-wide
chunk of K and the block adds the four partial sums in shared memory. Within each 64-wide chunk
of K the kernel assigns k to fragment slots in its own order, the same for x and w, so that
every thread loads 16 consecutive elements of a row; a dot product does not depend on the order
of its terms except by rounding, and the sum of each chunk's 16 products runs in fp32.

`use_small_gemm(model)` turns the model's linears that the kernel can take (`takes`: unquantized
bf16/fp16, K % 64 == 0, N % 8 == 0; fused ones included) into `SmallGemmLinear`, which calls
`small_gemm` where it `applies` (rows <= MAX_ROWS) and `pays` (more than 16 rows only on small
weights) and `nn.Linear`'s own matmul otherwise; on the CPU or Metal it changes nothing
(`available()` is False there). No model code is copied: the model's layers call their linears
as before.

Not thread-safe beyond MLX's own rules: the worker runs all MLX work on its engine thread.
"""
from __future__ import annotations

import hashlib
import os
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS = 64  # up to 4 m16 tiles: 4 rows of 16 tokens
WARPS = 4  # warps per block, splitting K
ALL_SHAPES_ROWS = 16  # `pays`: up to this many rows on every weight
BIG_WEIGHT = 1 << 22  # `pays`: above 16 rows only for weights of at most this many elements
MIN_BLOCKS = 96  # blocks `n_tiles` keeps at least (the H200 has 132 SMs)
K_CHUNK = 64  # k per warp per loop step (16 consecutive elements a thread); K must be a multiple

_HEADER = r"""
// 16 consecutive 16-bit elements at p into 8 registers (the lower address in the lower half):
// two 16-byte loads where p is 16-byte aligned, else 2-byte ones (x can be a view at any offset).
__device__ __forceinline__ void small_gemm_load16(const void* p, bool aligned, uint32_t* r) {
  if (aligned) {
    const uint4 u = reinterpret_cast<const uint4*>(p)[0], v = reinterpret_cast<const uint4*>(p)[1];
    r[0] = u.x; r[1] = u.y; r[2] = u.z; r[3] = u.w; r[4] = v.x; r[5] = v.y; r[6] = v.z; r[7] = v.w;
  } else {
    const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
    #pragma unroll
    for (int i = 0; i < 8; ++i) r[i] = (uint32_t)h[2 * i] | ((uint32_t)h[2 * i + 1] << 16);
  }
}
__device__ __forceinline__ void small_gemm_mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(SMALL_GEMM_F16)
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#endif
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"""

# The body of the kernel (MLX writes the signature: x, w[, b] then y). Template constants: K, N,
# MT (m16 tiles), HAS_BIAS. Warp v of a block takes the 64-chunks v, v + 4, v + 8, ... of K. Thread (g = lane / 4, q = lane % 4) of a warp: B fragment column g
# (w's row n0 + g), A fragment rows g and g + 8 of each m tile; within a 64-chunk of K it holds
# elements q*16 .. q*16+15 of those rows, and mma step s uses elements 4s .. 4s+3 of them as the
# fragment's k slots {2q, 2q+1} and {8+2q, 8+2q+1}.
_SOURCE = r"""
  const int M = x_shape[0];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int n0 = blockIdx.x * 8 * NT;
  const int k0 = q * 16;
  float acc[MT][NT][4];
  #pragma unroll
  for (int t = 0; t < MT; ++t) {
    #pragma unroll
    for (int j = 0; j < NT; ++j) { acc[t][j][0] = acc[t][j][1] = acc[t][j][2] = acc[t][j][3] = 0.f; }
  }
  const bool x_aligned = (reinterpret_cast<size_t>(x) & 15) == 0;  // K % 64 keeps every row's loads alike
  #pragma unroll 2
  for (int kc = warp * 64; kc < K; kc += 64 * WARPS_) {
    uint32_t wr[NT][8];
    #pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint4* wp = reinterpret_cast<const uint4*>(w + (size_t)(n0 + j * 8 + g) * K + k0 + kc);
      const uint4 w0 = wp[0], w1 = wp[1];
      wr[j][0] = w0.x; wr[j][1] = w0.y; wr[j][2] = w0.z; wr[j][3] = w0.w;
      wr[j][4] = w1.x; wr[j][5] = w1.y; wr[j][6] = w1.z; wr[j][7] = w1.w;
    }
    #pragma unroll
    for (int t = 0; t < MT; ++t) {
      const int r0 = t * 16 + g, r1 = r0 + 8;
      uint32_t ar0[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ar1[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (r0 < M) small_gemm_load16(x + (size_t)r0 * K + k0 + kc, x_aligned, ar0);
      if (r1 < M) small_gemm_load16(x + (size_t)r1 * K + k0 + kc, x_aligned, ar1);
      #pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint32_t a[4] = {ar0[2 * s], ar1[2 * s], ar0[2 * s + 1], ar1[2 * s + 1]};
        #pragma unroll
        for (int j = 0; j < NT; ++j) small_gemm_mma(acc[t][j], a, wr[j][2 * s], wr[j][2 * s + 1]);
      }
    }
  }
  __shared__ float part[WARPS_ - 1][MT][NT][4][32];
  if (warp > 0) {
    #pragma unroll
    for (int t = 0; t < MT; ++t) {
      #pragma unroll
      for (int j = 0; j < NT; ++j) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) part[warp - 1][t][j][i][lane] = acc[t][j][i];
      }
    }
  }
  __syncthreads();
  if (warp == 0) {
    #pragma unroll
    for (int t = 0; t < MT; ++t) {
      #pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int col = n0 + j * 8 + 2 * q;
        float c[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          c[i] = acc[t][j][i];
          #pragma unroll
          for (int v = 0; v < WARPS_ - 1; ++v) c[i] += part[v][t][j][i][lane];
        }
        if (HAS_BIAS) {
          const float b0 = static_cast<float>(BIAS_AT(col)), b1 = static_cast<float>(BIAS_AT(col + 1));
          c[0] += b0; c[1] += b1; c[2] += b0; c[3] += b1;
        }
        const int r0 = t * 16 + g, r1 = r0 + 8;
        if (r0 < M) STORE_PAIR(y + (size_t)r0 * N + col, c[0], c[1]);
        if (r1 < M) STORE_PAIR(y + (size_t)r1 * N + col, c[2], c[3]);
      }
    }
  }
"""


def _defines(half: bool, bias: bool) -> str:
    # Kept as macros so that one body serves both dtypes and the bias-less signature (which has
    # no `b` to name).
    store = ("*reinterpret_cast<__half2*>(p) = __floats2half2_rn(u, v)" if half
             else "*reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(u, v)")
    lines = [f"#define WARPS_ {WARPS}",
             f"#define STORE_PAIR(p, u, v) do {{ {store}; }} while (0)",
             f"#define BIAS_AT(i) {'b[i]' if bias else '0.f'}"]
    if half:
        lines.insert(0, "#define SMALL_GEMM_F16 1")
    return "\n".join(lines) + "\n"


_kernels: dict = {}


def _kernel(half: bool, bias: bool):
    key = (half, bias)
    if key not in _kernels:
        header = _defines(half, bias) + _HEADER
        # MLX caches compiled kernels on disk by name (and template values) only: a name that
        # carries the code's hash never picks up a kernel compiled from an older version.
        digest = hashlib.sha256((header + _SOURCE).encode()).hexdigest()[:12]
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"flashfleet_small_gemm_{'f16' if half else 'bf16'}{'_bias' if bias else ''}_{digest}",
            input_names=["x", "w", "b"] if bias else ["x", "w"], output_names=["y"],
            source=_SOURCE, header=header)
    return _kernels[key]


def available() -> bool:
    """Whether `small_gemm` can run here: MLX's CUDA backend on a GPU of compute capability 8.0
    or later (`mma.sync.m16n8k16` with bf16 needs sm_80: not a T4 or other Turing card; a GPU
    whose capability MLX does not report is assumed able), and not turned off with
    FLASHFLEET_SMALL_GEMM=0."""
    return cuda_sm80("FLASHFLEET_SMALL_GEMM")


def cuda_sm80(opt_out: str) -> bool:
    """MLX's CUDA backend on a GPU of compute capability 8.0 or later (or one whose capability
    MLX does not report), and the environment variable `opt_out` not "0": where this module's
    kernels may run."""
    if not mx.cuda.is_available() or os.environ.get(opt_out, "1") == "0":
        return False
    major = _compute_capability_major()
    return major is None or major >= 8


def _compute_capability_major() -> Optional[int]:
    info = mx.device_info()
    if "compute_capability_major" in info:
        return int(info["compute_capability_major"])
    arch = str(info.get("architecture", ""))  # "sm_90"
    return int(arch[3:-1]) if arch.startswith("sm_") and arch[3:].isdigit() and len(arch) > 4 else None


def applies(x: mx.array, weight: mx.array) -> bool:
    """Whether `small_gemm(x, weight)` handles these shapes and dtypes (else use a matmul):
    x (..., K) with at most MAX_ROWS rows in all, weight (N, K) of the same dtype, bf16 or fp16,
    K % 64 == 0 and N % 8 == 0."""
    if x.dtype not in (mx.bfloat16, mx.float16) or weight.dtype != x.dtype or weight.ndim != 2:
        return False
    N, K = weight.shape
    rows = x.size // max(1, x.shape[-1])
    return (x.shape[-1] == K and 1 <= rows <= MAX_ROWS and K % K_CHUNK == 0 and N % 8 == 0)


def pays(rows: int, N: int, K: int) -> bool:
    """Whether `SmallGemmLinear` should take a call of `rows` rows on an (N, K) weight: up to
    `ALL_SHAPES_ROWS` rows always, more only for weights of at most `BIG_WEIGHT` elements.
    Measured on the H200 (docs/benchmarks.md, "Small matmuls in one kernel"): at 16 rows the
    kernel's device time per call is within a few microseconds of cuBLAS's on every layer shape
    of the 1.5B target, and it saves host time on each; at 64 rows it is as fast on q/k/v and o
    (3.1 M and 2.4 M elements) but 1.8-1.9x cuBLAS's on the MLP's 27.5 M gate/up (x, re-read from
    L2 by every block, dominates) and 1.1-1.3x on its 13.8 M down, which on a machine with a fast
    host made a 4-row verify slower."""
    return rows <= ALL_SHAPES_ROWS or N * K <= BIG_WEIGHT


def n_tiles(N: int) -> int:
    """Output columns a block computes, in tiles of 8: the most of 4, 2, 1 that divides N and
    still leaves at least MIN_BLOCKS blocks. More columns a block read x fewer times (with 64 rows
    x is 0.2-1.1 MB, re-read from L2 by every block: the cost that made 64 rows slow at N = 17920);
    fewer keep every SM streaming weights when N is small."""
    for nt in (4, 2):
        if N % (8 * nt) == 0 and N // (8 * nt) >= MIN_BLOCKS:
            return nt
    return 1


def small_gemm(x: mx.array, weight: mx.array, bias: Optional[mx.array] = None) -> mx.array:
    """y = x @ weight.T (+ bias) as one CUDA kernel (tensor cores, fp32 accumulation).

    Args:
        x: (..., K) bf16 or fp16, at most MAX_ROWS (64) rows over its leading axes.
        weight: (N, K), x's dtype (an `nn.Linear` weight).
        bias: optional (N,), x's dtype.

    Returns:
        (..., N) in x's dtype. Equal to `x @ weight.T + bias` up to rounding (fp32 sums in another
        order than cuBLAS's; tests/test_small_gemm.py, on CUDA).

    Raises:
        ValueError: shapes or dtypes `applies` rejects; a bias of another shape or dtype.
        (MLX raises if the default device is not a CUDA GPU.)
    """
    if not applies(x, weight):
        raise ValueError(f"small_gemm: x {x.shape} {x.dtype} and weight {weight.shape} {weight.dtype} need "
                         f"bf16/fp16 alike, <= {MAX_ROWS} rows, K % {K_CHUNK} == 0, N % 8 == 0")
    N, K = weight.shape
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"small_gemm: bias {bias.shape} {bias.dtype}, expected ({N},) {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    half = x.dtype == mx.float16
    kernel = _kernel(half, bias is not None)
    inputs = [x2, weight] if bias is None else [x2, weight, bias]
    nt = n_tiles(N)
    (y,) = kernel(inputs=inputs, template=[("K", K), ("N", N), ("MT", (M + 15) // 16), ("NT", nt),
                                           ("HAS_BIAS", bias is not None)],
                  grid=(N // (8 * nt) * 32 * WARPS, 1, 1), threadgroup=(32 * WARPS, 1, 1),
                  output_shapes=[(M, N)], output_dtypes=[x.dtype])
    return y.reshape(*lead, N)


class SmallGemmLinear(nn.Linear):
    """An `nn.Linear` whose calls of a few rows run `small_gemm` where it `applies` and `pays`;
    every other call runs `nn.Linear`'s own. A one-row call without bias keeps MLX's GEMV
    (already a single kernel node). `use_small_gemm` turns existing linears into this class in
    place."""

    def __call__(self, x: mx.array) -> mx.array:
        bias = self.get("bias")
        rows = x.size // max(1, x.shape[-1])
        if ((bias is not None or rows > 1) and applies(x, self.weight)
                and pays(rows, *self.weight.shape)):
            return small_gemm(x, self.weight, bias)
        return super().__call__(x)


def takes(linear: nn.Module) -> bool:
    """Whether `small_gemm` can ever take calls of this module: a plain `nn.Linear` (not
    quantized) with a bf16 or fp16 (N, K) weight, K % 64 == 0 and N % 8 == 0."""
    if type(linear) is not nn.Linear:
        return False
    w = linear.weight
    return (w.dtype in (mx.bfloat16, mx.float16) and w.shape[1] % K_CHUNK == 0 and w.shape[0] % 8 == 0
            and ("bias" not in linear or linear.bias.dtype == w.dtype))


def use_small_gemm(model: nn.Module) -> int:
    """Turns every linear under `model` that `takes` accepts into a `SmallGemmLinear`, in place:
    the instance's class changes, its arrays stay, so every reference to it (a fused projection's
    `worker.fusion._Fused.linear` included) calls the new `__call__`. Quantized linears, float32
    ones, odd shapes and an `nn.Embedding`'s tied head are left alone. Call it after
    `worker.fusion.fuse_projections` and after any change of dtype (a linear cast later keeps the
    class; calls it no longer `applies` to run `nn.Linear`'s own).

    Returns:
        How many linears changed (0 where `available()` is False: nothing changes).
    """
    if not available():
        return 0
    swapped = 0
    for _, module in model.named_modules():
        if takes(module):
            module.__class__ = SmallGemmLinear
            swapped += 1
    return swapped
