"""Fused (flash-style) non-causal attention for the RoBERTa encoder, in Triton.

What: softmax(Q K^T * scale + key mask) V with attention-probability dropout, tiled
with an online softmax and fp32 accumulation, so nothing of size seqlen^2 is ever
stored. The backward recomputes the probabilities from the saved log-sum-exp
(FlashAttention-2: Dao, 2023): a preprocess kernel for delta = rowsum(dO * O), one
kernel for dK/dV (one program per key block) and one for dQ (one program per
query block). No atomics anywhere, so the backward is deterministic.

Inputs are (batch, seqlen, nheads, headdim) in fp16/bf16/fp32, head dims 32/64/128,
any seqlen (tails are masked in the kernel). `attention_mask` (batch, seqlen), 1 =
attend, masks keys; a row with no key to attend returns zeros. `attention_varlen`
takes packed (total_tokens, nheads, headdim) with `cu_seqlens` like
flash-attention's varlen API. `attention_qkvpacked` takes the QKV projection's output
(..., 3, nheads, headdim) as it is, padded or packed, and its backward writes one
dQKV, as flash-attention's *_qkvpacked functions do (the model calls this one).

Dropout uses counter-based Philox-4x32-10 keyed by a 64-bit seed; the counter is
(query row, key column // 8, batch * nheads + head, offset), and the four 32-bit
outputs of one call, split into 16-bit halves, serve 8 neighbouring key columns
(half the Philox work of one 32-bit word per column; the keep threshold has
1/65536 resolution, so the drop rate is within 8e-6 of dropout_p). The mask therefore does
not depend on block sizes or launch order, the backward regenerates it exactly, and
`attention_dropout_mask` exports it (the same kernel helper) for testing. Without
an explicit `dropout_seed` the seed/offset come from torch's RNG (torch.randint on
the device), so torch.manual_seed controls them.

The ops are registered with torch.library.custom_op (forward and backward, with
fake implementations) so torch.compile can trace through them (fullgraph).

Caveats: on a CPU the kernels run only under Triton's interpreter
(TRITON_INTERPRET=1 before triton is imported), where small blocks are used and
bf16 tl.dot is computed wrongly unless patched (the tests patch it:
tests/interpreter_bf16.py). fp32 inputs use IEEE fp32
dots (exact-ish parity with PyTorch; slow: no tensor cores, registers spill), or TF32
where torch.set_float32_matmul_precision allows it. GPU block sizes are autotuned over
configs sensible for Ampere/Hopper (no Hopper-only features), keyed on a seqlen
bucket, with the results cached on disk; ROBERTA_FAST_AUTOTUNE=0 runs each
kernel's default for the head dim (default_order) instead (no one-off tuning).
Below sm_80 Triton lowers tl.dot to FMA, so the model does not launch these kernels
there (roberta_fast.ops.attention_impl sends V100s and T4s to SDPA's memory-efficient
kernel). benchmarks/compile_report.py compiles every variant and config for
sm_70/75/80/90 on any machine and reports registers, spills and tensor-core
instructions (CI compiles what the model launches on each). Not yet run
or measured on a GPU when this was written (none was available): see
benchmarks/bench_attention.py.
"""
import inspect
import math
import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ._utils import LAUNCH_OPTIONS, dropout_threshold, on_device, philox_rand16

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Triton chooses the interpreter when a kernel is decorated, i.e. at import.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRET_BLOCK = 64  # preprocess and dropout-mask kernels under the interpreter


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _seq_bounds(CuSeqlens, b, seqlen, IS_VARLEN: tl.constexpr):
    """(first token, length) of sequence b: packed via cu_seqlens, or padded (0, seqlen)."""
    if IS_VARLEN:
        start = tl.load(CuSeqlens + b)
        length = tl.load(CuSeqlens + b + 1) - start
        start = start.to(tl.int64)  # start * token stride passes 2^31 in a big batch
    else:
        start = 0
        length = seqlen
    return start, length


@triton.jit
def _program_ids(seqlen, BLOCK: tl.constexpr):
    """(block along the sequence, batch * head) of this program. One grid axis holds both, sequence
    blocks fastest (the order of a (blocks, batch * heads) grid): CUDA's second axis stops at 65,535,
    which a batch of 5,462 sequences of 12 heads passes."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(seqlen, BLOCK)
    bh = pid // n_blocks
    return pid - bh * n_blocks, bh


@triton.jit
def _dropout_rand(Rng, bh, offs_m, start_n, BLOCK_N: tl.constexpr):
    """16-bit randoms for query rows offs_m x key columns start_n..start_n+BLOCK_N: keep = rand >= thresh."""
    return philox_rand16(tl.load(Rng), offs_m, start_n, bh, tl.load(Rng + 1).to(tl.int32), BLOCK_N)


@triton.jit
def _key_valid(KeyMask, b, stride_mb, offs_n, length, HAS_MASK: tl.constexpr):
    """Which key columns may be attended: inside the sequence and not padding."""
    valid = offs_n < length
    if HAS_MASK:
        valid = valid & (tl.load(KeyMask + b * stride_mb + offs_n, mask=valid, other=0) != 0)
    return valid


@triton.jit
def _attn_fwd_block(
    acc, l_i, m_i, q, k_base, v_base, KeyMask, Rng, b, bh, stride_mb, stride_ks, stride_vs, offs_m, offs_d,
    start_n, length, scale_log2, thresh,
    BLOCK_N: tl.constexpr, MASK_KEYS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) with one key block; MASK_KEYS for tail / padded blocks."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASK_KEYS:
        key_in = (offs_n < length)[:, None]
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=key_in, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=key_in, other=0.0)
    else:
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :])
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :])
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N), unscaled
    if MASK_KEYS:
        qk = tl.where(_key_valid(KeyMask, b, stride_mb, offs_n, length, HAS_MASK)[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)  # log2 units; scale > 0
    if MASK_KEYS:
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every key so far masked: avoid inf - inf
    else:
        m_new_safe = m_new
    p = tl.exp2(qk * scale_log2 - m_new_safe[:, None])
    alpha = tl.exp2(m_i - m_new_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if HAS_DROPOUT:
        p = tl.where(_dropout_rand(Rng, bh, offs_m, start_n, BLOCK_N) >= thresh, p, 0.0)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["nheads", "seqlen", "seqlen_bucket"])
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, KeyMask, CuSeqlens, Rng,
    scale_log2, thresh, inv_keep,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh, stride_mb, nheads, seqlen, seqlen_bucket,  # seqlen_bucket: autotune key only
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program = BLOCK_M query rows of one (batch, head): online softmax over key blocks."""
    pid_m, bh = _program_ids(seqlen, BLOCK_M)
    b = bh // nheads
    h = bh % nheads
    b64 = b.to(tl.int64)  # batch offsets of Q, K, V, O and their gradients pass 2^31 in a big batch
    start, length = _seq_bounds(CuSeqlens, b, seqlen, IS_VARLEN)
    if pid_m * BLOCK_M >= length:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < length
    q = tl.load(Q + b64 * stride_qb + h * stride_qh + (start + offs_m[:, None]) * stride_qs + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    k_base = K + b64 * stride_kb + h * stride_kh + start * stride_ks
    v_base = V + b64 * stride_vb + h * stride_vh + start * stride_vs

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Whole key blocks without padding skip all masking; the tail (or every block of a padded batch) masks.
    n_full = 0 if HAS_MASK else (length // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        acc, l_i, m_i = _attn_fwd_block(acc, l_i, m_i, q, k_base, v_base, KeyMask, Rng, b, bh, stride_mb,
                                        stride_ks, stride_vs, offs_m, offs_d, start_n, length, scale_log2, thresh,
                                        BLOCK_N, False, HAS_MASK, HAS_DROPOUT, PRECISION)
    for start_n in range(n_full, length, BLOCK_N):
        acc, l_i, m_i = _attn_fwd_block(acc, l_i, m_i, q, k_base, v_base, KeyMask, Rng, b, bh, stride_mb,
                                        stride_ks, stride_vs, offs_m, offs_d, start_n, length, scale_log2, thresh,
                                        BLOCK_N, True, HAS_MASK, HAS_DROPOUT, PRECISION)

    empty = l_i == 0.0  # no key to attend: output zeros, lse = +inf makes the backward's p = 0
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc * (inv_keep / l_safe)[:, None]
    tl.store(Out + b64 * stride_ob + h * stride_oh + (start + offs_m[:, None]) * stride_os + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
    lse = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
    tl.store(Lse + b * stride_lb + h * stride_lh + start + offs_m, lse, mask=row_ok)


@triton.jit
def _attn_bwd_preprocess_kernel(
    Out, DOut, Delta, CuSeqlens,
    stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
    stride_lb, stride_lh, nheads, seqlen,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """delta = rowsum(dO * O) in fp32 (equals rowsum(dP * P), also under dropout)."""
    pid_m, bh = _program_ids(seqlen, BLOCK_M)
    b = bh // nheads
    h = bh % nheads
    b64 = b.to(tl.int64)  # batch offsets of Q, K, V, O and their gradients pass 2^31 in a big batch
    start, length = _seq_bounds(CuSeqlens, b, seqlen, IS_VARLEN)
    if pid_m * BLOCK_M >= length:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < length
    rows = start + offs_m[:, None]
    o = tl.load(Out + b64 * stride_ob + h * stride_oh + rows * stride_os + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)
    do = tl.load(DOut + b64 * stride_db + h * stride_dh + rows * stride_ds + offs_d[None, :], mask=row_ok[:, None],
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b * stride_lb + h * stride_lh + start + offs_m, delta, mask=row_ok)


@triton.jit(do_not_specialize=["nheads", "seqlen", "seqlen_bucket"])
def _attn_bwd_dkdv_kernel(
    Q, K, V, DOut, DK, DV, Lse, Delta, KeyMask, CuSeqlens, Rng,
    scale_log2, softmax_scale, thresh, inv_keep,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh,
    stride_gb, stride_gs, stride_gh,  # dK and dV (same layout)
    stride_lb, stride_lh, stride_mb, nheads, seqlen, seqlen_bucket,  # seqlen_bucket: autotune key only
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program = BLOCK_N keys of one (batch, head); loops over all query blocks.

    Works in the transposed (key, query) orientation so P^T and dS^T feed the dots
    without a layout transpose (as in Triton's fused-attention tutorial).
    """
    pid_n, bh = _program_ids(seqlen, BLOCK_N)
    b = bh // nheads
    h = bh % nheads
    b64 = b.to(tl.int64)  # batch offsets of Q, K, V, O and their gradients pass 2^31 in a big batch
    start, length = _seq_bounds(CuSeqlens, b, seqlen, IS_VARLEN)
    if pid_n * BLOCK_N >= length:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_in = offs_n < length
    valid_n = _key_valid(KeyMask, b, stride_mb, offs_n, length, HAS_MASK)  # (BLOCK_N,)
    k = tl.load(K + b64 * stride_kb + h * stride_kh + (start + offs_n[:, None]) * stride_ks + offs_d[None, :],
                mask=key_in[:, None], other=0.0)
    v = tl.load(V + b64 * stride_vb + h * stride_vh + (start + offs_n[:, None]) * stride_vs + offs_d[None, :],
                mask=key_in[:, None], other=0.0)
    q_base = Q + b64 * stride_qb + h * stride_qh + start * stride_qs
    do_base = DOut + b64 * stride_db + h * stride_dh + start * stride_ds
    lse_base = Lse + b * stride_lb + h * stride_lh + start
    delta_base = Delta + b * stride_lb + h * stride_lh + start

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start_m in range(0, length, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < length
        q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_ds + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))  # tail rows: p = 0
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
        p_t = tl.exp2(s_t * scale_log2 - lse[None, :])
        if HAS_MASK:  # keys past the end need no mask: their dK/dV rows are never stored
            p_t = tl.where(valid_n[:, None], p_t, 0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
        if HAS_DROPOUT:
            keep_t = tl.trans(_dropout_rand(Rng, bh, offs_m, pid_n * BLOCK_N, BLOCK_N)) >= thresh
            pd_t = tl.where(keep_t, p_t * inv_keep, 0.0)
            dp_t = tl.where(keep_t, dp_t * inv_keep, 0.0)
        else:
            pd_t = p_t
        dv = tl.dot(pd_t.to(q.dtype), do, dv, input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    dk = dk * softmax_scale
    rows = start + offs_n[:, None]
    tl.store(DK + b64 * stride_gb + h * stride_gh + rows * stride_gs + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=key_in[:, None])
    tl.store(DV + b64 * stride_gb + h * stride_gh + rows * stride_gs + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=key_in[:, None])


@triton.jit(do_not_specialize=["nheads", "seqlen", "seqlen_bucket"])
def _attn_bwd_dq_kernel(
    Q, K, V, DOut, DQ, Lse, Delta, KeyMask, CuSeqlens, Rng,
    scale_log2, softmax_scale, thresh, inv_keep,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh,
    stride_gb, stride_gs, stride_gh,  # dQ
    stride_lb, stride_lh, stride_mb, nheads, seqlen, seqlen_bucket,  # seqlen_bucket: autotune key only
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program = BLOCK_M query rows of one (batch, head); loops over all key blocks."""
    pid_m, bh = _program_ids(seqlen, BLOCK_M)
    b = bh // nheads
    h = bh % nheads
    b64 = b.to(tl.int64)  # batch offsets of Q, K, V, O and their gradients pass 2^31 in a big batch
    start, length = _seq_bounds(CuSeqlens, b, seqlen, IS_VARLEN)
    if pid_m * BLOCK_M >= length:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < length
    rows = start + offs_m[:, None]
    q = tl.load(Q + b64 * stride_qb + h * stride_qh + rows * stride_qs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DOut + b64 * stride_db + h * stride_dh + rows * stride_ds + offs_d[None, :], mask=row_ok[:, None],
                 other=0.0)
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + start + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + b * stride_lb + h * stride_lh + start + offs_m, mask=row_ok, other=0.0)
    k_base = K + b64 * stride_kb + h * stride_kh + start * stride_ks
    v_base = V + b64 * stride_vb + h * stride_vh + start * stride_vs

    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, length, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_in = offs_n < length
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=key_in[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=key_in[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        # keys past the end are masked too: there s = 0, so p = exp2(-lse) overflows when the row's
        # scores are all very negative, and inf * (k = 0) would make dQ NaN
        p = tl.where(_key_valid(KeyMask, b, stride_mb, offs_n, length, HAS_MASK)[None, :],
                     tl.exp2(s * scale_log2 - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
        if HAS_DROPOUT:
            keep = _dropout_rand(Rng, bh, offs_m, start_n, BLOCK_N) >= thresh
            dp = tl.where(keep, dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    dq = dq * softmax_scale
    tl.store(DQ + b64 * stride_gb + h * stride_gh + rows * stride_gs + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _dropout_mask_kernel(Mask, Rng, thresh, nheads, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes the keep mask (batch, nheads, seqlen_q, seqlen_k) the attention kernels use."""
    pid_m, bh = _program_ids(seqlen_q, BLOCK_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    for start_n in range(0, seqlen_k, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = _dropout_rand(Rng, bh, offs_m, start_n, BLOCK_N) >= thresh
        ptrs = Mask + (bh * seqlen_q + offs_m[:, None]).to(tl.int64) * seqlen_k + offs_n[None, :]
        tl.store(ptrs, keep.to(tl.int8), mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k))


# ----------------------------------------------------------------------------- autotuning
# Keyed on a power-of-two bucket of seqlen, so a new length (varlen's max_seqlen,
# a differently padded batch) reuses the tuning instead of re-benchmarking.
_KEY = ["seqlen_bucket", "HEAD_DIM", "HAS_MASK", "IS_VARLEN", "HAS_DROPOUT"]


def _configs(rows):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in rows]


# Sensible for Ampere and Hopper (no Hopper-only features): BLOCK_M 128 for the
# forward, long key blocks for dK/dV and long query blocks for dQ, as FA2 and Triton's
# fused-attention tutorial do. Pruned with benchmarks/compile_report.py (sm_80 / sm_90):
# every training variant (dropout with a mask, varlen or neither) has a config that
# compiles without register spills on both. Autotuning times them all; with it off
# (ROBERTA_FAST_AUTOTUNE=0) the head dim's default (_DEFAULTS) runs, or the first
# config after it that fits the GPU's shared memory. Measured with compile_report
# (Triton 3.9, fp16/bf16): the defaults spill on neither sm_80 nor sm_90 at head dims
# 64 (RoBERTa's) and 128, except the head-dim-128 forward on varlen without dropout at
# sm_80 (24 bytes); fp32 spills at every head dim. The last config, (32, 32, 4, 2),
# fits the shared memory of an A100 (and for dQ of an H100) with fp32 at head dim 128.
_FWD_CONFIGS = _configs([(128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
                         (64, 64, 8, 3), (32, 32, 4, 2)])
_DKDV_CONFIGS = _configs([(32, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 8, 3), (32, 64, 4, 4),
                          (32, 64, 8, 3), (32, 32, 4, 2)])
_DQ_CONFIGS = _configs([(128, 32, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 64, 8, 3),
                        (64, 32, 4, 4), (32, 32, 4, 2)])
# (BLOCK_M, BLOCK_N, warps, stages) with autotuning off, by head dim; the list's first otherwise
_DEFAULTS = {"fwd": {128: (64, 64, 8, 3)}, "dkdv": {128: (32, 64, 8, 3)}, "dq": {}}


def default_order(name, head_dim):
    """Kernel `name`'s configs in the order autotuning-off tries them: the head dim's default, then
    the list from there on (smaller tiles, for when it does not fit the shared memory)."""
    configs = _KERNELS[name][1]
    default = _DEFAULTS[name].get(head_dim)
    start = 0
    if default is not None:
        start = next(i for i, c in enumerate(configs) if
                     (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) == default)
    return configs[start:]


# Under the interpreter: small tiles keep the tests quick and still exercise several
# blocks and ragged tails at seqlen 130 / 193, with BLOCK_M != BLOCK_N both ways round.
_INTERPRET_META = {"fwd": {"BLOCK_M": 32, "BLOCK_N": 64}, "dkdv": {"BLOCK_M": 64, "BLOCK_N": 32},
                   "dq": {"BLOCK_M": 32, "BLOCK_N": 64}}
_KERNELS = {"fwd": (_attn_fwd_kernel, _FWD_CONFIGS), "dkdv": (_attn_bwd_dkdv_kernel, _DKDV_CONFIGS),
            "dq": (_attn_bwd_dq_kernel, _DQ_CONFIGS)}
# Tuning results are cached on disk (Triton's cache dir) where this Triton can, so
# only the first process on a machine pays for tuning a variant.
_CACHE = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
_TUNED = {}  # name -> its autotuned kernel, built at its first tuned launch: Triton < 3.4 asks the GPU
# driver for a benchmarker when an autotuner is built (import without a GPU: 'RuntimeError: 0 active drivers')


def _tuned(name):
    if name not in _TUNED:
        kernel, configs = _KERNELS[name]
        _TUNED[name] = triton.autotune(configs=configs, key=_KEY, **_CACHE)(kernel)
    return _TUNED[name]


def autotune_enabled():
    """GPU block sizes are autotuned unless ROBERTA_FAST_AUTOTUNE=0 (then each kernel's first config that fits).

    Turning it off saves the one-off tuning (every config is compiled and timed per
    dtype / head dim / variant), e.g. for test runs; read at every launch.
    """
    return os.environ.get("ROBERTA_FAST_AUTOTUNE", "1") != "0"


def _launch(name, grid_block, seqlen, batch_heads, *args, **constexprs):
    """Launch kernel `name` over blocks of seqlen along grid_block times batch * heads (_program_ids)."""
    args = (*args, seqlen, max(16, triton.next_power_of_2(seqlen)))  # + seqlen_bucket, the autotune key
    grid = lambda m: (triton.cdiv(seqlen, m[grid_block]) * batch_heads,)  # noqa: E731
    kernel, configs = _KERNELS[name]
    if _INTERPRET:
        kernel[grid](*args, **constexprs, **_INTERPRET_META[name], **LAUNCH_OPTIONS)
    elif autotune_enabled():
        _tuned(name)[grid](*args, **constexprs, **LAUNCH_OPTIONS)  # configs that do not fit the GPU time as infinite
    else:
        _launch_first_fitting(name, kernel, default_order(name, constexprs["HEAD_DIM"]), grid, args, constexprs)


_FIRST_FITTING = {}  # (kernel, GPU, constexprs) -> index of the first config that fits, autotuning off


def _launch_first_fitting(name, kernel, configs, grid, args, constexprs):
    """The first config the GPU can run: fp32 at head dim 128 needs more shared memory than the default's."""
    key = (name, args[0].device, tuple(sorted(constexprs.items())))  # args[0]: q
    for i in range(_FIRST_FITTING.get(key, 0), len(configs)):
        config = configs[i]
        try:  # OutOfResources is raised before the launch: nothing has run
            kernel[grid](*args, **constexprs, **config.all_kwargs(), **LAUNCH_OPTIONS)
        except OutOfResources:
            continue
        _FIRST_FITTING[key] = i
        return
    raise RuntimeError(f"attention: no {name} config fits this GPU's shared memory for {constexprs}; "
                       "use bf16/fp16 inputs (fp32 at head dim 128 needs the most)")


# ----------------------------------------------------------------------------- launchers
def _bsh_strides(x, varlen):
    """(batch, seq, head) strides of (B, S, H, D), or of packed (T, H, D) with batch stride 0."""
    return (0, x.stride(0), x.stride(1)) if varlen else (x.stride(0), x.stride(1), x.stride(2))


def _dims(q, cu_seqlens, max_seqlen):
    """batch, seqlen (padded length or max_seqlen), nheads, headdim."""
    if cu_seqlens is None:
        return q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    return cu_seqlens.numel() - 1, max_seqlen, q.shape[1], q.shape[2]


def _dropout_args(dropout_p):
    """(thresh, inv_keep): keep where the 16-bit random >= thresh (drop rate thresh / 65536 ~ dropout_p)."""
    return dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p)


def _lse_layout(q, cu_seqlens, batch, nheads, seqlen):
    """Empty fp32 buffer for the per-row log-sum-exp: (B, H, S) padded, (H, T) packed; + strides."""
    if cu_seqlens is None:
        lse = torch.empty((batch, nheads, seqlen), device=q.device, dtype=torch.float32)
        return lse, (lse.stride(0), lse.stride(1))
    lse = torch.empty((nheads, q.shape[0]), device=q.device, dtype=torch.float32)
    return lse, (0, lse.stride(0))


def _dot_precision(dtype):
    """fp32 dots in IEEE fp32, or in TF32 where the user allows it for matmuls
    (torch.set_float32_matmul_precision("high")), as PyTorch's own matmuls do; the
    setting means nothing for fp16/bf16 inputs."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _common(q, key_mask, cu_seqlens, rng):
    """varlen, constexpr flags, (mask, cu_seqlens, rng) pointers, mask batch stride."""
    varlen = cu_seqlens is not None
    flags = dict(HAS_MASK=key_mask is not None, IS_VARLEN=varlen, HAS_DROPOUT=rng is not None,
                 PRECISION=_dot_precision(q.dtype))
    dummy = q  # pointer arguments a constexpr flag switches off are never read
    ptrs = (dummy if key_mask is None else key_mask, dummy if cu_seqlens is None else cu_seqlens,
            dummy if rng is None else rng)
    stride_mb = 0 if key_mask is None else key_mask.stride(0)
    return varlen, flags, ptrs, stride_mb


def _forward(q, k, v, key_mask, cu_seqlens, max_seqlen, rng, dropout_p, softmax_scale):
    batch, seqlen, nheads, head_dim = _dims(q, cu_seqlens, max_seqlen)
    varlen, flags, (mask_ptr, cu_ptr, rng_ptr), stride_mb = _common(q, key_mask, cu_seqlens, rng)
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse, lse_strides = _lse_layout(q, cu_seqlens, batch, nheads, seqlen)
    thresh, inv_keep = _dropout_args(dropout_p)
    with on_device(q.device):
        _launch("fwd", "BLOCK_M", seqlen, batch * nheads,
                q, k, v, out, lse, mask_ptr, cu_ptr, rng_ptr, softmax_scale * LOG2E, thresh, inv_keep,
                *_bsh_strides(q, varlen), *_bsh_strides(k, varlen), *_bsh_strides(v, varlen),
                *_bsh_strides(out, varlen), *lse_strides, stride_mb, nheads, HEAD_DIM=head_dim, **flags)
    return out, lse


def _backward(dout, q, k, v, out, lse, key_mask, cu_seqlens, max_seqlen, rng, dropout_p, softmax_scale,
              grads=None):
    """(dq, dk, dv), written into `grads` (three views, dk and dv alike strided) when given."""
    batch, seqlen, nheads, head_dim = _dims(q, cu_seqlens, max_seqlen)
    varlen, flags, (mask_ptr, cu_ptr, rng_ptr), stride_mb = _common(q, key_mask, cu_seqlens, rng)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    lse_strides = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    delta = torch.empty_like(lse)
    pre_block = _INTERPRET_BLOCK if _INTERPRET else 128
    dq, dk, dv = grads or (torch.empty(x.shape, device=x.device, dtype=x.dtype) for x in (q, k, v))
    thresh, inv_keep = _dropout_args(dropout_p)
    common = (lse, delta, mask_ptr, cu_ptr, rng_ptr, softmax_scale * LOG2E, softmax_scale, thresh, inv_keep,
              *_bsh_strides(q, varlen), *_bsh_strides(k, varlen), *_bsh_strides(v, varlen),
              *_bsh_strides(dout, varlen))
    tail = (*lse_strides, stride_mb, nheads)
    with on_device(q.device):
        _attn_bwd_preprocess_kernel[(triton.cdiv(seqlen, pre_block) * batch * nheads,)](
            out, dout, delta, cu_ptr, *_bsh_strides(out, varlen), *_bsh_strides(dout, varlen), *lse_strides,
            nheads, seqlen, HEAD_DIM=head_dim, BLOCK_M=pre_block, IS_VARLEN=varlen, **LAUNCH_OPTIONS,
        )
        _launch("dkdv", "BLOCK_N", seqlen, batch * nheads, q, k, v, dout, dk, dv, *common,
                *_bsh_strides(dk, varlen), *tail, HEAD_DIM=head_dim, **flags)
        _launch("dq", "BLOCK_M", seqlen, batch * nheads, q, k, v, dout, dq, *common,
                *_bsh_strides(dq, varlen), *tail, HEAD_DIM=head_dim, **flags)
    return dq, dk, dv


# ----------------------------------------------------------------------------- torch ops
@torch.library.custom_op("roberta_fast::attention_fwd", mutates_args=())
def _attention_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], max_seqlen: int, rng: Optional[torch.Tensor],
    dropout_p: float, softmax_scale: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): out like q; lse fp32 (B, H, S) padded or (H, T) packed, log2 units."""
    return _forward(q, k, v, key_mask, cu_seqlens, max_seqlen, rng, dropout_p, softmax_scale)


def _fake_forward(q, cu_seqlens):
    """(out, lse) of the forward's shapes, for torch.compile's tracing."""
    if cu_seqlens is None:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


@_attention_fwd_op.register_fake
def _(q, k, v, key_mask, cu_seqlens, max_seqlen, rng, dropout_p, softmax_scale):
    return _fake_forward(q, cu_seqlens)


@torch.library.custom_op("roberta_fast::attention_bwd", mutates_args=())
def _attention_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, key_mask: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], max_seqlen: int,
    rng: Optional[torch.Tensor], dropout_p: float, softmax_scale: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), recomputing the probabilities from lse (and the dropout mask from rng)."""
    return _backward(dout, q, k, v, out, lse, key_mask, cu_seqlens, max_seqlen, rng, dropout_p, softmax_scale)


@_attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse, key_mask, cu_seqlens, max_seqlen, rng, dropout_p, softmax_scale):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, key_mask, cu_seqlens, max_seqlen, rng, dropout_p, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_mask, cu_seqlens, rng)
    ctx.max_seqlen, ctx.dropout_p, ctx.softmax_scale = max_seqlen, dropout_p, softmax_scale
    ctx.mark_non_differentiable(lse)


def _backward_rule(ctx, dout, _dlse):
    q, k, v, out, lse, key_mask, cu_seqlens, rng = ctx.saved_tensors
    dq, dk, dv = _attention_bwd_op(dout, q, k, v, out, lse, key_mask, cu_seqlens, ctx.max_seqlen, rng,
                                   ctx.dropout_p, ctx.softmax_scale)
    return dq, dk, dv, None, None, None, None, None, None


_attention_fwd_op.register_autograd(_backward_rule, setup_context=_setup_context)


@torch.library.custom_op("roberta_fast::attention_qkvpacked_fwd", mutates_args=())
def _attention_qkvpacked_fwd_op(
    qkv: torch.Tensor, key_mask: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], max_seqlen: int,
    rng: Optional[torch.Tensor], dropout_p: float, softmax_scale: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """As attention_fwd on q, k, v = qkv.unbind(-3) (strided views: nothing is copied)."""
    return _forward(*qkv.unbind(-3), key_mask, cu_seqlens, max_seqlen, rng, dropout_p, softmax_scale)


@_attention_qkvpacked_fwd_op.register_fake
def _(qkv, key_mask, cu_seqlens, max_seqlen, rng, dropout_p, softmax_scale):
    return _fake_forward(qkv.select(-3, 0), cu_seqlens)


@torch.library.custom_op("roberta_fast::attention_qkvpacked_bwd", mutates_args=())
def _attention_qkvpacked_bwd_op(
    dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, key_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], max_seqlen: int, rng: Optional[torch.Tensor], dropout_p: float,
    softmax_scale: float,
) -> torch.Tensor:
    """dqkv like qkv: the kernels write dq, dk, dv into its three slices (no stack afterwards)."""
    dqkv = torch.empty(qkv.shape, device=qkv.device, dtype=qkv.dtype)
    _backward(dout, *qkv.unbind(-3), out, lse, key_mask, cu_seqlens, max_seqlen, rng, dropout_p, softmax_scale,
              grads=dqkv.unbind(-3))
    return dqkv


@_attention_qkvpacked_bwd_op.register_fake
def _(dout, qkv, out, lse, key_mask, cu_seqlens, max_seqlen, rng, dropout_p, softmax_scale):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _setup_context_qkvpacked(ctx, inputs, output):
    qkv, key_mask, cu_seqlens, max_seqlen, rng, dropout_p, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse, key_mask, cu_seqlens, rng)
    ctx.max_seqlen, ctx.dropout_p, ctx.softmax_scale = max_seqlen, dropout_p, softmax_scale
    ctx.mark_non_differentiable(lse)


def _backward_rule_qkvpacked(ctx, dout, _dlse):
    qkv, out, lse, key_mask, cu_seqlens, rng = ctx.saved_tensors
    dqkv = _attention_qkvpacked_bwd_op(dout, qkv, out, lse, key_mask, cu_seqlens, ctx.max_seqlen, rng,
                                       ctx.dropout_p, ctx.softmax_scale)
    return dqkv, None, None, None, None, None, None


_attention_qkvpacked_fwd_op.register_autograd(_backward_rule_qkvpacked, setup_context=_setup_context_qkvpacked)


# ----------------------------------------------------------------------------- validation
def _check_qkv(q, k, v, ndim, layout):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor {layout}, got {type(x).__name__}")
        if x.dim() != ndim:
            raise ValueError(f"attention: {name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"attention: q, k, v must have the same shape {layout}; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"attention: q, k, v must share one dtype among float16, bfloat16, float32; got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention: q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"attention: head dim {q.shape[-1]} is not supported; supported head dims are "
                         f"{SUPPORTED_HEAD_DIMS}")
    if q.device.type == "cpu" and not _INTERPRET:
        raise ValueError("attention: CPU tensors run only under Triton's interpreter; set TRITON_INTERPRET=1 "
                         "before importing triton (or roberta_fast.kernels), or move the tensors to a CUDA GPU")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"attention: tensors must be on a CUDA GPU (or the CPU under TRITON_INTERPRET=1), "
                         f"got {q.device}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    # The kernels offset by batch and by a sequence's first token in 64 bits; within a sequence, and into
    # the fp32 (batch, heads, seqlen) statistics, in 32 bits (RoBERTa's 512-token sequences are far below).
    if q.shape[:-1].numel() >= 2**31 or (ndim == 4 and any(_sequence_span(x) >= 2**31 for x in (q, k, v))):
        raise ValueError(f"attention: q, k, v of shape {tuple(q.shape)} pass the kernels' 32-bit indexing "
                         "within a sequence (or 2^31 token-head rows in all); split the sequences")
    return q, k, v


def _sequence_span(x, max_seqlen=None):
    """Elements one sequence of x (batch, seqlen, ...) or packed (total_tokens, ...) spans: seqlen, or
    max_seqlen of packed tokens, rows of the token stride, plus one token's heads."""
    token = 1 if x.dim() == 4 else 0
    rows = x.shape[token] if max_seqlen is None else max_seqlen
    return (rows - 1) * x.stride(token) + sum((n - 1) * st for n, st in zip(x.shape[token + 1:],
                                                                               x.stride()[token + 1:]))


def _check_common(head_dim, dropout_p, softmax_scale):
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
        raise ValueError(f"attention: softmax_scale must be a positive float or None, got {softmax_scale!r}")
    return float(dropout_p), float(softmax_scale)


def _key_mask(attention_mask, q):
    """(B, S) 0/1 mask of any dtype -> contiguous uint8 for the kernels (bool: no copy, no sync)."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention: attention_mask must be a torch.Tensor (batch, seqlen), got "
                        f"{type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != (q.shape[0], q.shape[1]):
        raise ValueError(f"attention: attention_mask must have shape (batch, seqlen) = {(q.shape[0], q.shape[1])}, "
                         f"got {tuple(attention_mask.shape)}")
    if attention_mask.device != q.device:
        raise ValueError(f"attention: attention_mask is on {attention_mask.device} but q is on {q.device}")
    if attention_mask.dtype != torch.bool:
        if attention_mask.is_complex():
            raise TypeError("attention: attention_mask must be bool, integer or float 0/1, not complex")
        if not torch.compiler.is_compiling() and bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            raise ValueError("attention: attention_mask must hold 0/1 (1 = attend), like the HF tokenizer's mask; "
                             "an additive mask (0 / -inf) is not accepted. Pass a bool mask to skip this check.")
        attention_mask = attention_mask != 0
    return attention_mask.contiguous().view(torch.uint8)


def _rng_state(dropout_p, dropout_seed, device):
    """int64 (seed, offset) on the device, or None without dropout; torch.manual_seed controls the default."""
    if dropout_p == 0.0:
        return None
    if dropout_seed is None:
        return torch.randint(0, 2**62, (2,), device=device, dtype=torch.int64)
    if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int) or not 0 <= dropout_seed < 2**63:
        raise ValueError(f"attention: dropout_seed must be an int in [0, 2**63) or None, got {dropout_seed!r}")
    return torch.tensor([dropout_seed, 0], device=device, dtype=torch.int64)


# ----------------------------------------------------------------------------- public API
def attention(q, k, v, attention_mask=None, dropout_p=0.0, softmax_scale=None, *, dropout_seed=None):
    """Fused non-causal attention; q, k, v (batch, seqlen, nheads, headdim) -> (batch, seqlen, nheads, headdim).

    attention_mask: (batch, seqlen), 1 = attend (bool, int or float 0/1), masks keys;
    a query with no key to attend gets zeros. dropout_p: attention-probability
    dropout (pass 0 in eval). dropout_seed: fixes the Philox seed (offset 0); by
    default the seed comes from torch's generator on q's device. softmax_scale:
    defaults to 1/sqrt(headdim).
    """
    q, k, v = _check_qkv(q, k, v, 4, "(batch, seqlen, nheads, headdim)")
    args = _padded_args(q, attention_mask, dropout_p, softmax_scale, dropout_seed)
    return _attention_fwd_op(q, k, v, *args)[0]


def attention_varlen(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, *, dropout_seed=None,
                     validate=True):
    """Attention over packed sequences: q, k, v (total_tokens, nheads, headdim) -> same shape.

    cu_seqlens: int32 (batch + 1,) cumulative lengths starting at 0 and ending at
    total_tokens; max_seqlen: the longest length. Sequence i occupies tokens
    cu_seqlens[i]:cu_seqlens[i+1] and attends only within itself. Dropout matches
    `attention` on the right-padded batch when max_seqlen equals its seqlen.
    validate=False skips the value checks of cu_seqlens (they synchronise with the
    GPU); they are also skipped under torch.compile.
    """
    q, k, v = _check_qkv(q, k, v, 3, "(total_tokens, nheads, headdim)")
    args = _varlen_args(q, cu_seqlens, max_seqlen, dropout_p, softmax_scale, dropout_seed, validate)
    return _attention_fwd_op(q, k, v, *args)[0]


def attention_qkvpacked(qkv, attention_mask=None, dropout_p=0.0, softmax_scale=None, *, cu_seqlens=None,
                        max_seqlen=None, dropout_seed=None, validate=True):
    """`attention` (or with cu_seqlens `attention_varlen`) on q, k, v = qkv.unbind(-3).

    qkv: (batch, seqlen, 3, nheads, headdim), or packed (total_tokens, 3, nheads,
    headdim) with cu_seqlens and max_seqlen: the fused QKV projection's output viewed
    as is, as flash-attention's *_qkvpacked functions take it. The same results as
    the separate-tensor functions; the backward writes dq, dk and dv straight into
    one dqkv, so autograd does not stack three gradients into it (a copy of
    3 · tokens · hidden values per layer).
    """
    varlen = cu_seqlens is not None
    layout = "(total_tokens, 3, nheads, headdim)" if varlen else "(batch, seqlen, 3, nheads, headdim)"
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4 + (not varlen) or qkv.shape[-3] != 3:
        got = tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__
        raise ValueError(f"attention_qkvpacked: qkv must be {layout}" +
                         ("" if varlen else " (or packed tokens with cu_seqlens)") + f", got {got}")
    if varlen and attention_mask is not None:
        raise ValueError("attention_qkvpacked: pass attention_mask or cu_seqlens, not both; packed tokens "
                         "attend within their cu_seqlens segment")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q, _, _ = _check_qkv(*qkv.unbind(-3), qkv.dim() - 1, layout)
    if varlen:
        args = _varlen_args(q, cu_seqlens, max_seqlen, dropout_p, softmax_scale, dropout_seed, validate)
    else:
        args = _padded_args(q, attention_mask, dropout_p, softmax_scale, dropout_seed)
    return _attention_qkvpacked_fwd_op(qkv, *args)[0]


def _padded_args(q, attention_mask, dropout_p, softmax_scale, dropout_seed):
    """The forward op's arguments after q, k, v for a (batch, seqlen, nheads, headdim) call, checked."""
    dropout_p, softmax_scale = _check_common(q.shape[3], dropout_p, softmax_scale)
    key_mask = _key_mask(attention_mask, q)
    rng = _rng_state(dropout_p, dropout_seed, q.device)
    return key_mask, None, q.shape[1], rng, dropout_p, softmax_scale


def _varlen_args(q, cu_seqlens, max_seqlen, dropout_p, softmax_scale, dropout_seed, validate):
    """The forward op's arguments after q, k, v for a packed (total_tokens, nheads, headdim) call, checked."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 \
            or cu_seqlens.numel() < 2:
        raise TypeError("attention_varlen: cu_seqlens must be an int32 tensor (batch + 1,) of cumulative lengths, "
                        "e.g. F.pad(mask.sum(1).cumsum(0), (1, 0)).to(torch.int32)")
    if cu_seqlens.device != q.device:
        raise ValueError(f"attention_varlen: cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, torch.SymInt)) or \
            (isinstance(max_seqlen, int) and max_seqlen < 1):
        raise ValueError(f"attention_varlen: max_seqlen must be a positive int, got {max_seqlen!r}")
    if isinstance(max_seqlen, int) and _sequence_span(q, max_seqlen) >= 2**31:
        raise ValueError(f"attention_varlen: sequences of up to {max_seqlen} tokens of q {tuple(q.shape)} pass the "
                         "kernels' 32-bit indexing within a sequence; split the sequences")
    dropout_p, softmax_scale = _check_common(q.shape[2], dropout_p, softmax_scale)
    if validate and not torch.compiler.is_compiling():
        lengths = cu_seqlens.diff()
        first, last, shortest, longest = torch.stack(
            [cu_seqlens[0], cu_seqlens[-1], lengths.min(), lengths.max()]).tolist()
        if first != 0 or last != q.shape[0] or shortest < 0:
            raise ValueError(f"attention_varlen: cu_seqlens must rise from 0 to total_tokens = {q.shape[0]}, got "
                             f"first {first}, last {last}, shortest length {shortest}")
        if longest > max_seqlen:
            raise ValueError(f"attention_varlen: max_seqlen = {max_seqlen} but a sequence has {longest} tokens")
    rng = _rng_state(dropout_p, dropout_seed, q.device)
    return None, cu_seqlens.contiguous(), max_seqlen, rng, dropout_p, softmax_scale


def attention_dropout_mask(batch, nheads, seqlen_q, seqlen_k, dropout_p, seed, device, offset=0):
    """The keep mask (batch, nheads, seqlen_q, seqlen_k), True = kept, that the kernels draw for (seed, offset).

    For testing: `attention(..., dropout_p=p, dropout_seed=seed)` equals
    `attention_ref(..., dropout_p=p, dropout_mask=attention_dropout_mask(..., p, seed, ...))`.
    Entry [b, h, i, j] depends only on (b, h, i, j), not on the shape asked for, so
    sequence b of a varlen call uses mask[b, :, :len_b, :len_b].
    """
    device = torch.device(device)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention_dropout_mask: dropout_p must be in [0, 1), got {dropout_p!r}")
    if device.type == "cpu" and not _INTERPRET:
        raise ValueError("attention_dropout_mask: CPU needs TRITON_INTERPRET=1 set before importing triton")
    mask = torch.empty((batch, nheads, seqlen_q, seqlen_k), device=device, dtype=torch.int8)
    rng = torch.tensor([seed, offset], device=device, dtype=torch.int64)
    thresh, _ = _dropout_args(float(dropout_p))
    block_m, block_n = (_INTERPRET_BLOCK, _INTERPRET_BLOCK) if _INTERPRET else (64, 64)
    with on_device(device):
        _dropout_mask_kernel[(triton.cdiv(seqlen_q, block_m) * batch * nheads,)](
            mask, rng, thresh, nheads, seqlen_q, seqlen_k, BLOCK_M=block_m, BLOCK_N=block_n, **LAUNCH_OPTIONS)
    return mask.bool()


def attention_ref(q, k, v, attention_mask=None, dropout_p=0.0, softmax_scale=None, dropout_mask=None, *,
                  upcast=True):
    """Plain-PyTorch attention, (batch, seqlen, nheads, headdim), in fp32 math or better (upcast=True).

    Keys where attention_mask is 0 get no weight; rows with no key get zeros.
    dropout_mask (batch, nheads, seqlen, seqlen), True = kept, replaces a fresh
    Bernoulli draw when dropout_p > 0. upcast=False computes in the input dtype
    (PyTorch's own low-precision error, the yardstick for the kernel's tolerance).
    """
    dtype = q.dtype
    if upcast:  # fp32 math (fp64 inputs stay fp64: a reference for fp32 runs)
        math_dtype = torch.promote_types(dtype, torch.float32)
        q, k, v = q.to(math_dtype), k.to(math_dtype), v.to(math_dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    scores = torch.einsum("bshd,bthd->bhst", q, k) * scale  # (B, H, S, S)
    if attention_mask is not None:
        keep_key = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
        scores = scores.masked_fill(~keep_key, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    if attention_mask is not None:
        probs = probs * keep_key.any(dim=-1, keepdim=True)  # a row with no key -> zeros
    if dropout_p > 0.0:
        if dropout_mask is None:
            dropout_mask = torch.rand_like(probs) >= dropout_p
        probs = probs * dropout_mask / (1.0 - dropout_p)
    return torch.einsum("bhst,bthd->bshd", probs.to(v.dtype), v).to(dtype)
