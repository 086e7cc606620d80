"""The floor of one rf-fused training step, part by part: FLOPs, fewest bytes, least time. No GPU needed.

For each part of the step throughput.py times for `rf-fused` (the fused backend under
autocast with fp32 master weights, the residual stream in fp32 as Hugging Face keeps
it, the MLM head on the predicted tokens only, FusedAdam with the gradient norm), this
counts the FLOPs the kernels execute and the fewest bytes they must move through
device memory (each input read once, each output written once), and the time each
takes at the device's ceilings: matmul FLOPs at the measured bf16 matmul rate, bytes
at the measured copy bandwidth. A part's floor is the larger of the two; the kernels
run one after another, so the step's floor is their sum, and model FLOPs (DESIGN.md's
PaLM convention, `roberta_fast.model.training_flops`) over that floor, over the
datasheet peak, is the highest MFU this design can reach. A measured profile
(throughput.py --profile) shows how far each part is from its floor.

    python benchmarks/roofline.py                                   # base, seq 512, batch 32, H100 ceilings
    python benchmarks/roofline.py --model large --seq-len 128 --batch 256
    python benchmarks/roofline.py --residual-dtype bf16              # a bf16 residual stream instead
    python benchmarks/roofline.py --gpu v100                         # fp16, SDPA attention, datasheet ceilings

Ceilings default to an H100 SXM as measured on the lent machine (device/KINDS.md,
2026-11-13: 798 TFLOP/s for an 8192^3 bf16 matmul on random data, 3.0 TB/s for a
device-to-device copy counting reads and writes); MFU is over the 989 TFLOP/s datasheet
peak. `--gpu h200` takes the lent H200's, measured the same way (device/KINDS.md, 2026-10-28:
788 TFLOP/s, 4.3 TB/s of its 4.8 TB/s HBM3e), over the same 989 TFLOP/s peak (gpu_session.sh
picks the column by the GPU's name). `--gpu a100|v100|t4` take datasheet ceilings instead (no such
GPU was lent to measure them), and on V100/T4 the attention SDPA's memory-efficient kernel runs
(ops.attention_impl). Counted in bytes: activations in the autocast dtype (2 bytes), the residual
stream and everything fp32 in 4. Not counted: the host, launch gaps, the L2 cache
(re-reads of K/V tiles by attention programs are taken to hit it), small vectors
(biases, LayerNorm statistics). The attention executes 9 matmuls per layer (forward
2; the deterministic backward 7: dK/dV recomputes QK^T and dO V^T, and dQ recomputes
both again) against the 6 the model-FLOP convention counts.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from roberta_fast.config import RobertaConfig
from roberta_fast.model import training_flops

ACT = 2  # bytes of an activation under autocast (bf16 / fp16)
FP32 = 4


@dataclass(frozen=True)
class Gpu:
    matmul_tflops: float  # half-precision matmul ceiling
    copy_tbs: float  # device-to-device copy, reads + writes
    peak_tflops: float  # datasheet dense fp16/bf16 tensor-core peak
    attention: str  # what ops.attention_impl runs there
    source: str


GPUS = {
    "h100": Gpu(798.0, 3.0, 989.0, "triton", "H100 SXM, ceilings measured on the lent machine (2026-11-13)"),
    # the same convention as the H100's (measured, not datasheet): 4.3 TB/s is 90% of the H200's 4.8 TB/s HBM3e
    # datasheet figure, as the H100's 3.0 is of its 3.35; the dense fp16/bf16 peak is the H100 SXM's 989
    "h200": Gpu(788.0, 4.3, 989.0, "triton", "H200 SXM, ceilings measured on the lent machine (2026-10-28; "
                "datasheet: HBM3e 4.8 TB/s, dense bf16 989 TFLOP/s as the H100 SXM)"),
    "a100": Gpu(312.0, 2.039, 312.0, "triton", "A100 SXM 80GB, datasheet bf16 peak and bandwidth (not measured)"),
    "v100": Gpu(125.0, 0.9, 125.0, "sdpa", "V100 SXM2, datasheet fp16 tensor-core peak and HBM2 bandwidth (not "
                "measured); attention on SDPA's memory-efficient kernel (no Triton tensor cores below sm_80)"),
    "t4": Gpu(65.0, 0.32, 65.0, "sdpa", "T4, datasheet fp16 tensor-core peak and GDDR6 bandwidth (not measured; "
              "its 70 W cap keeps sustained clocks below the peak's); attention on SDPA"),
}


def gpu_of(name: str, capability: tuple[int, int]) -> str:
    """The GPUS entry of a CUDA device: by its name where one capability is several GPUs (sm_90: an H100
    or an H200, whose memory is 1.4x as fast), else by its capability; h100 for any other."""
    if "H200" in name.upper():
        return "h200"
    return {(7, 0): "v100", (7, 5): "t4", (8, 0): "a100"}.get(tuple(capability), "h100")


@dataclass
class Part:
    name: str
    flops: float  # executed
    model_flops: float  # counted by the PaLM convention
    bytes: float  # fewest bytes moved

    def floor_s(self, matmul_flops: float, copy_bytes: float) -> float:
        return max(self.flops / matmul_flops, self.bytes / copy_bytes)


def _gemm(m: int, n: int, k: int, a_bytes=ACT, b_bytes=ACT, out_bytes=ACT):
    """(flops, bytes) of C (m, n) = A (m, k) @ B (k, n), each operand read once."""
    return 2.0 * m * n * k, float(m * k * a_bytes + k * n * b_bytes + m * n * out_bytes)


def _linear_fwd_bwd(tokens: int, n_in: int, n_out: int):
    """Forward, input grad and weight grad of a linear layer over `tokens` rows (bf16 weights)."""
    parts = [_gemm(tokens, n_out, n_in), _gemm(tokens, n_in, n_out), _gemm(n_in, n_out, tokens)]
    return sum(f for f, _ in parts), sum(b for _, b in parts)


def step_parts(cfg: RobertaConfig, batch: int, seq_len: int, mlm_probability: float = 0.15,
               residual_bytes: int = FP32, attention: str = "triton") -> list[Part]:
    """The parts of one training step of the fused model (one micro-batch), in execution order.
    attention: "triton" (sm_80+) or "sdpa" (what ops.attention_impl runs below sm_80)."""
    T, S, L = batch * seq_len, seq_len, cfg.num_hidden_layers
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    P = round(mlm_probability * T)  # predicted tokens
    r = residual_bytes
    copy = r != ACT  # the LayerNorm also writes the half copy the next matmul reads

    # encoder matmuls: QKV, attention output, FFN in and out, each forward + two grads
    flops = gemm_bytes = 0.0
    for n_in, n_out in ((H, 3 * H), (H, H), (H, I), (I, H)):
        f, b = _linear_fwd_bwd(T, n_in, n_out)
        flops, gemm_bytes = flops + f, gemm_bytes + b
    encoder_matmul_params = 4 * H * H + 2 * H * I
    parts = [Part("encoder matmuls", L * flops, L * 6.0 * encoder_matmul_params * T, L * gemm_bytes)]

    unit = 2.0 * T * S * H  # one (seqlen x seqlen) matmul over every head of a layer
    if attention == "triton":
        # in (T, H) activations: forward reads q, k, v, writes out (3 + 1); delta = rowsum(dO * O) reads
        # out and dO (2); dK/dV reads q, k, v, dO, writes dK, dV (4 + 2); dQ reads q, k, v, dO, writes dQ (4 + 1)
        attn_matmuls, attn_bytes = 9, (4 + 2 + 6 + 5) * T * H * ACT
    else:  # SDPA's memory-efficient kernel (below sm_80): 2 forward + 5 backward matmuls (P recomputed once);
        # forward reads q, k, v, writes out (4), backward reads q, k, v, out, dO, writes dq, dk, dv (8);
        # q, k, v made contiguous out of the QKV projection and their grads packed back (6 + 6)
        attn_matmuls, attn_bytes = 7, (4 + 8 + 6 + 6) * T * H * ACT
    parts.append(Part(f"attention fwd+bwd ({attention})", L * attn_matmuls * unit, L * 6 * unit, L * attn_bytes))

    # two residual + dropout + LayerNorms per layer: forward reads x and the residual, writes y
    # (and its half copy); backward reads dy (and the copy's grad), x, the residual, writes dx, dresidual
    ln_fwd = ACT + r + r + (ACT if copy else 0)
    ln_bwd = r + ACT + ACT + r + ACT + r  # the copy's grad (or, with no copy, the summed grad) read alike
    parts.append(Part("dropout+residual+LayerNorm x2", 0, 0, L * 2 * T * H * (ln_fwd + ln_bwd)))
    # bias+GELU: forward reads h, writes g; backward reads dg and h, writes dh
    parts.append(Part("bias+GELU", 0, 0, L * T * I * ACT * (2 + 3)))

    # embeddings (fp32 tables; per token and hidden unit). Forward: gather word and position rows,
    # add them, add the token-type row, LayerNorm, dropout (+ bool mask), autocast's cast for the first
    # QKV: 4+4+4, 4+4, 4+4, 4+4+1, 4+2 bytes. Backward: the cast's grad to fp32 and its sum with the
    # residual grad (2+4, 4+4+4), dropout (4+1+4), LayerNorm (4+4+4), rows added into the word and
    # position grads (4+8 each), the token-type grad (4); and the zeroed (V, H) fp32 word grad
    emb = T * H * (43 + 67) + V * H * FP32
    parts.append(Part("embeddings", 0, 0, emb))

    # MLM head on the P predicted rows. Forward: gather them (4+4), autocast's cast (4+2); backward:
    # the cast's grad (2+4), their grads scattered into a zeroed (T, H) fp32 grad (4T + 4+8 per row)
    f_dense, b_dense = _linear_fwd_bwd(P, H, H)
    f_dec, b_dec = _linear_fwd_bwd(P, H, V)
    parts.append(Part("MLM head matmuls", f_dense + f_dec, 6.0 * (H * H + H * V) * P, b_dense + b_dec))
    gather = P * H * (8 + 6 + 6 + 12) + T * H * FP32
    gelu_ln = P * H * ACT * (5 + 5)  # bias+GELU as above; LayerNorm: read x, write y; read dy, x, write dx
    parts.append(Part("MLM head gather, GELU, LayerNorm", 0, 0, gather + gelu_ln))
    # cross-entropy: forward reads the logits; backward reads them again and writes dlogits
    parts.append(Part("cross-entropy", 0, 0, P * V * ACT * 3))

    # weights: autocast casts each fp32 matmul weight to bf16 once per forward (4+2) and each bf16
    # weight grad back to fp32 for .grad (2+4); the decoder's grad is added to the word table's (4+4+4)
    matmul_params = L * encoder_matmul_params + H * H + V * H
    parts.append(Part("weight casts", 0, 0, matmul_params * 12 + V * H * 12))
    # FusedAdam: the gradient norm (read grads), then read param, grad, m, v and write param, m, v
    parts.append(Part("optimizer (norm + Adam)", 0, 0, cfg.num_parameters() * FP32 * (1 + 4 + 3)))
    return parts


def report(cfg: RobertaConfig, batch: int, seq_len: int, matmul_tflops: float, copy_tbs: float,
           peak_tflops: float, mlm_probability: float = 0.15, residual_bytes: int = FP32,
           attention: str = "triton") -> dict:
    parts = step_parts(cfg, batch, seq_len, mlm_probability, residual_bytes, attention)
    rate, bandwidth = matmul_tflops * 1e12, copy_tbs * 1e12
    rows = [{**asdict(p), "floor_ms": p.floor_s(rate, bandwidth) * 1e3,
             "bound": "compute" if p.flops / rate >= p.bytes / bandwidth else "memory"} for p in parts]
    floor = sum(row["floor_ms"] for row in rows) / 1e3
    tokens, predicted = batch * seq_len, round(mlm_probability * batch * seq_len)
    model_flops = training_flops(cfg, tokens, predicted, seq_len)
    return {"batch": batch, "seq_len": seq_len, "tokens": tokens, "predicted": predicted,
            "residual_bytes": residual_bytes, "matmul_tflops": matmul_tflops, "copy_tbs": copy_tbs,
            "peak_tflops": peak_tflops, "attention": attention, "parts": rows, "floor_ms": floor * 1e3,
            "model_flops": model_flops, "max_tokens_per_s": tokens / floor,
            "max_mfu": model_flops / floor / (peak_tflops * 1e12)}


def format_report(r: dict) -> str:
    lines = [f"{'part':<34} {'TFLOP':>7} {'GB':>7} {'floor ms':>9} {'share':>6}  bound"]
    for p in r["parts"]:
        lines.append(f"{p['name']:<34} {p['flops'] / 1e12:>7.2f} {p['bytes'] / 1e9:>7.2f} {p['floor_ms']:>9.2f} "
                     f"{p['floor_ms'] / r['floor_ms']:>6.1%}  {p['bound']}")
    lines.append(f"{'step':<34} {sum(p['flops'] for p in r['parts']) / 1e12:>7.2f} "
                 f"{sum(p['bytes'] for p in r['parts']) / 1e9:>7.2f} {r['floor_ms']:>9.2f}")
    lines.append(f"batch {r['batch']} x seq {r['seq_len']}, residual stream {r['residual_bytes']}-byte, "
                 f"ceilings {r['matmul_tflops']:g} TFLOP/s and {r['copy_tbs']:g} TB/s: at most "
                 f"{r['max_tokens_per_s']:,.0f} tokens/s, MFU at most {r['max_mfu']:.1%} "
                 f"(model {r['model_flops'] / 1e12:.2f} TFLOP per step over {r['peak_tflops']:g} TFLOP/s)")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="base", choices=("tiny", "base", "large"))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=32, help="sequences per micro-batch")
    p.add_argument("--mlm-probability", type=float, default=0.15)
    p.add_argument("--residual-dtype", default="fp32", choices=("fp32", "bf16"),
                   help="the residual stream's dtype (fp32: as HF under autocast, what the model does)")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS),
                   help="ceilings and attention of this GPU (flags below override the ceilings)")
    p.add_argument("--matmul-tflops", type=float, help="half-precision matmul ceiling (default: the GPU's)")
    p.add_argument("--copy-tbs", type=float, help="device-to-device copy, TB/s (default: the GPU's)")
    p.add_argument("--peak-tflops", type=float, help="datasheet dense half-precision peak, for MFU (default: the GPU's)")
    p.add_argument("--json", metavar="PATH", help="also write the report to this JSON file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = RobertaConfig.preset(args.model)
    gpu = GPUS[args.gpu]
    r = report(cfg, args.batch, args.seq_len, args.matmul_tflops or gpu.matmul_tflops, args.copy_tbs or gpu.copy_tbs,
               args.peak_tflops or gpu.peak_tflops, args.mlm_probability,
               FP32 if args.residual_dtype == "fp32" else ACT, gpu.attention)
    print(f"{args.gpu}: {gpu.source}")
    print(format_report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "gpu": args.gpu, **r}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
