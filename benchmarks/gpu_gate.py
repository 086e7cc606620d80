"""The correctness gate of a GPU session: is the fused model right on this device, at the record's shape?

    python benchmarks/gpu_gate.py --json gate.json                     # roberta-base, seq 512, fp16 and bf16
    python benchmarks/gpu_gate.py --model tiny --seq-len 64 --batch 2   # any machine (CPU: Triton's interpreter)

Two checks, one verdict (`passed` in the JSON), which throughput.py --gate reads to mark
its figures verified or not (benchmarks/gpu_session.sh runs both in one call):

1. The model: backend="fused" against backend="reference" on the same weights (random
   init plus noise, so biases and LayerNorms are not 0 and 1), fp32 weights under
   autocast to each of --dtypes, on the step the record times (packed sequences without
   padding, attention_mask=None, the MLM head over the predicted tokens only,
   masked_only=True), in eval mode (dropout draws differ between backends, so it is off).
   The loss and every parameter's gradient must agree within tests/test_fused_model.py's
   tolerances (TOLERANCE below): |fused - ref| <= tol * max|ref| (+ 1e-6 for gradients).
   gpu_session.sh runs it with ROBERTA_FAST_AUTOTUNE=0 (the default block sizes: no tuning
   time); autotuned sizes change the tiling, not the arithmetic.
2. The CUDA tests of FusedAdam and the masking (`pytest tests/test_fused_adam.py
   tests/test_mask_tokens.py -k "cuda or gpu"`), junit XML beside the JSON. On a GPU at
   least one must pass; on a CPU they are not run (they would all skip).

On a CPU the fused kernels run in Triton's interpreter, with tests/interpreter_bf16.py's
patch so that bf16 is computed as a GPU does: that is only a rehearsal of the GPU gate.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import _common as bc  # noqa: E402

bc.use_interpreter_without_gpu()  # before triton is imported

SCHEMA = "roberta_fast.gate/1"
# tests/test_fused_model.py's fused-vs-reference tolerances under autocast (fraction of max |ref|)
TOLERANCE = {"fp16": 2e-2, "bf16": 6e-2}
GRAD_ATOL = 1e-6
CUDA_TESTS = ["tests/test_fused_adam.py", "tests/test_mask_tokens.py"]
CUDA_SELECTION = "cuda or gpu"


def _install_interpreter_bf16() -> None:
    """Under Triton's interpreter, compute bf16 dots and casts as a GPU does (the tests' patch)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.path.insert(0, str(ROOT / "tests"))
        import interpreter_bf16

        interpreter_bf16.install()


def build_models(model: str, device):
    """(reference, fused): the preset `model` with the same random weights, fp32, eval mode."""
    import roberta_fast as rf

    torch.manual_seed(0)
    cfg = rf.RobertaConfig.preset(model)
    reference = rf.RobertaForMaskedLM(cfg, backend="reference")
    with torch.no_grad():  # biases and LayerNorms start at 0 and 1: make them random too
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    fused = rf.RobertaForMaskedLM(cfg, backend="fused")
    fused.load_state_dict(reference.state_dict())
    return [m.to(device).eval() for m in (reference, fused)]


def batch(vocab_size: int, batch_size: int, seq_len: int, device):
    """Packed sequences (`<s> ... </s> ... </s>`, no padding) and 15% of ordinary tokens as labels."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab_size - 1, (batch_size, seq_len), generator=g)  # (batch, seq)
    ids[:, 0], ids[:, seq_len // 2], ids[:, -1] = 0, 2, 2
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.15, ids, -100)
    labels[ids <= 3] = -100
    labels[:, 1] = ids[:, 1]  # at least one prediction per row
    return ids.to(device), labels.to(device)


def loss_and_grads(model, ids, labels, dtype: str):
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[dtype])):
        loss = model(ids, attention_mask=None, labels=labels, masked_only=True).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.detach().float() for n, p in model.named_parameters()
                                   if p.grad is not None}


def compare(ref, fused, dtype: str) -> list[dict]:
    """One check per quantity: the loss and each parameter's gradient, with its error and allowance."""
    tol = TOLERANCE[dtype]
    (ref_loss, ref_grads), (fused_loss, fused_grads) = ref, fused
    checks = [{"dtype": dtype, "what": "loss", "error": abs(float(fused_loss - ref_loss)),
               "allowed": tol * abs(float(ref_loss)), "reference": float(ref_loss), "fused": float(fused_loss)}]
    for name, grad in ref_grads.items():
        got = fused_grads.get(name)
        if got is None:
            checks.append({"dtype": dtype, "what": f"grad {name}", "error": None, "allowed": None,
                           "ok": False, "reason": "the fused model has no gradient for it"})
            continue
        checks.append({"dtype": dtype, "what": f"grad {name}", "error": float((got - grad).abs().max()),
                       "allowed": tol * float(grad.abs().max()) + GRAD_ATOL})
    for c in checks:
        if "ok" not in c:  # NaN never passes: the comparison is False
            c["ok"] = bool(c["error"] <= c["allowed"])
    return checks


def model_gate(model: str, seq_len: int, batch_size: int, dtypes, device) -> list[dict]:
    reference, fused = build_models(model, device)
    ids, labels = batch(reference.config.vocab_size, batch_size, seq_len, device)
    checks = []
    for dtype in dtypes:
        checks += compare(loss_and_grads(reference, ids, labels, dtype),
                          loss_and_grads(fused, ids, labels, dtype), dtype)
    return checks


def junit_counts(path: Path) -> dict:
    """tests / failures / errors / skipped of a pytest junit XML (zeros when it is missing)."""
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return counts
    for suite in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    return counts


def cuda_tests(junit: Path, timeout: int) -> dict:
    """Run the CUDA tests of FusedAdam and the masking in a subprocess; their outcome."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *CUDA_TESTS,
           "-k", CUDA_SELECTION, f"--junitxml={junit}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        returncode, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        returncode, tail = None, f"timed out after {timeout} s"
    counts = junit_counts(junit)
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"command": cmd[1:], "returncode": returncode, **counts, "junit": junit.name, "output_tail": tail}


def verdict(checks: list[dict], tests: dict, on_gpu: bool) -> list[str]:
    """Why the gate failed (empty when it passed)."""
    why = [f"{c['dtype']} {c['what']}: error {c['error']} > allowed {c['allowed']}" if c["error"] is not None
           else f"{c['dtype']} {c['what']}: {c['reason']}" for c in checks if not c["ok"]]
    if not checks:
        why.append("no model check ran")
    if tests["returncode"] is None:
        why.append(f"CUDA tests: no verdict ({tests.get('reason') or tests.get('output_tail')})")
    elif tests["returncode"] != 0:
        why.append(f"CUDA tests: pytest exit {tests['returncode']} ({tests['failures']} failed, "
                   f"{tests['errors']} errors)")
    elif on_gpu and tests["passed"] < 1:
        why.append("CUDA tests: none ran on the GPU (all skipped or deselected)")
    return why


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="base", choices=("tiny", "base", "large"))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="sequences (default 4)")
    p.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=sorted(TOLERANCE))
    p.add_argument("--skip-tests", action="store_true", help="only the model check (the gate then fails: "
                                                             "the CUDA tests are part of it)")
    p.add_argument("--tests-timeout", type=int, default=300, help="seconds for the CUDA tests")
    p.add_argument("--device", help="cuda | cpu (default: cuda when present); throughput.py --gate verifies only "
                                    "a run on the same device, so give both the same --device")
    p.add_argument("--json", type=Path, required=True, help="write the verdict and every check here")
    args = p.parse_args(argv)
    if args.seq_len < 8 or args.batch < 1:
        p.error(f"--seq-len must be >= 8 and --batch >= 1, got {args.seq_len} and {args.batch}")
    device = torch.device(args.device) if args.device else bc.default_device()
    _install_interpreter_bf16()
    env = bc.environment(device)
    t0 = time.perf_counter()
    try:
        checks = model_gate(args.model, args.seq_len, args.batch, args.dtypes, device)
        crash = None
    except Exception as err:  # a crash is a failed gate, recorded, not a lost stage
        checks, crash = [], f"{type(err).__name__}: {err}"[:1000]
    model_s = time.perf_counter() - t0
    junit = args.json.with_name(args.json.stem + "-tests.xml")
    not_run = {"returncode": None, "tests": 0, "passed": 0, "failures": 0, "errors": 0, "skipped": 0}
    worst = {d: max((c["error"] / c["allowed"] for c in checks if c["dtype"] == d and c["error"] is not None
                     and c["allowed"]), default=None) for d in args.dtypes}

    def write(tests: dict) -> list[str]:
        """Write the verdict with these test results to --json; its failures."""
        failures = ([f"model check crashed: {crash}"] if crash else []) + verdict(checks, tests, device.type == "cuda")
        bc.write_json(str(args.json), env, checks, schema=SCHEMA, passed=not failures, failures=failures,
                      setting={"model": args.model, "seq_len": args.seq_len, "batch": args.batch,
                               "dtypes": args.dtypes, "tolerance": TOLERANCE},
                      worst_error_over_allowed=worst, model_check_s=round(model_s, 1), tests=tests)
        return failures

    if args.skip_tests:
        tests = {**not_run, "reason": "--skip-tests"}
    elif device.type != "cuda":  # they would all skip; the dry sanitize stage runs the same selection
        tests = {**not_run, "returncode": 0, "reason": "no CUDA device: the CUDA tests were not run"}
    else:  # written now too: a gate stopped during its tests (the session's step cap) still says how the model did
        write({**not_run, "reason": "the gate was stopped during the CUDA tests"})
        tests = cuda_tests(junit, args.tests_timeout)
    failures = write(tests)
    for d, w in worst.items():
        print(f"{args.model}/seq{args.seq_len} {d}: worst error / allowed = "
              + ("n/a" if w is None else f"{w:.3f}"))
    print(f"CUDA tests: {tests['passed']} passed, {tests['failures']} failed, {tests['errors']} errors, "
          f"{tests['skipped']} skipped")
    print("gate: PASSED" if not failures else "gate: FAILED\n  " + "\n  ".join(failures[:20]))
    print(f"wrote {args.json}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
