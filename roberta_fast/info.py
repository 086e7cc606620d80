"""`python -m roberta_fast.info`: what roberta_fast runs on this machine, for first checks and bug reports.

    python -m roberta_fast.info            # versions, the compiled extension, and per device what runs there
    python -m roberta_fast.info --check    # also run each fast path once on tiny inputs against its reference

As `python -m torch.utils.collect_env` or `python -m xformers.info`: paste the output into a bug
report. Each device's line comes from the functions the model and the trainer decide with
(precision.describe_auto, ops.describe_attention, quantization.default_engine), so it says what
runs, not what should. --check exits with status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys

import torch

from . import __version__

PACKAGES = ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy")
OPTIONAL = ("onnxruntime", "onnx", "tensorboard", "pyarrow", "zstandard", "datasets", "peft")  # extras


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> list[str]:
    import roberta_fast

    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {torch.version.hip}" if torch.version.hip \
        else "no CUDA"
    return [f"roberta_fast {__version__} ({roberta_fast.__path__[0]}), Python {platform.python_version()}, "
            f"{platform.system()} {platform.machine()}",
            ", ".join(f"{n} {_version(n)}" + (f" ({cuda})" if n == "torch" else "") for n in PACKAGES),
            "optional: " + ", ".join(f"{n} {_version(n)}" for n in OPTIONAL)]


def extension() -> str:
    from . import _ext

    try:
        ext = _ext.load()
    except ImportError as err:
        return f"extension: NOT BUILT: {str(err).splitlines()[0]} (build: pip install --no-build-isolation -e .)"
    cuda = ("CUDA ops built" if ext.built_with_cuda() else
            "CPU ops only (no CUDA ops: FusedAdam and mask_tokens refuse GPU tensors; build with torch's CUDA "
            "and nvcc)")
    return f"extension: roberta_fast._C {ext.version()}, {cuda}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def cpu() -> list[str]:
    from .quantization import default_engine, has_int8_dot_products

    flag = lambda name: bool(getattr(torch.cpu, name, lambda: False)())  # noqa: E731  (torch's private probes)
    bf16 = flag("_is_avx512_bf16_supported") or flag("_is_amx_tile_supported")
    int8 = has_int8_dot_products()
    return [f"cpu: {_cpu_name()}, {torch.get_num_threads()} torch threads, vector ISA "
            f"{torch.backends.cpu.get_cpu_capability()}",
            "  runs the reference backend (PyTorch ops; inference unpadded), fp32; "
            + ("bf16 native (AVX512-BF16 / AMX): .to(torch.bfloat16) pays" if bf16 else
               "bf16 emulated here (no AVX512-BF16 / AMX): keep fp32"),
            f"  rf.quantize: engine {default_engine()}, "
            + ("8-bit activations (VNNI / AMX int8 dot products)" if int8 else
               "7-bit activations (no VNNI / AMX); engine='fbgemm' for single short requests")]


def gpus() -> list[str]:
    from . import ops
    from .precision import describe_auto

    if not torch.cuda.is_available():
        return ["gpu: none visible to torch" + (" (this torch has no CUDA)" if not torch.version.cuda
                                                and not torch.version.hip else "")]
    lines, arches = [], torch.cuda.get_arch_list()
    for i in range(torch.cuda.device_count()):
        device = torch.device("cuda", i)
        props = torch.cuda.get_device_properties(device)
        major, minor = ops.device_capability(device)
        backend = "fused" if ops._triton_available() else "reference (triton does not import)"
        covered = any(a in (f"sm_{major}{minor}", f"compute_{major}{minor}") for a in arches) or not arches
        lines += [f"gpu {i}: {props.name}, sm_{major}{minor}, {props.total_memory / 2 ** 30:.1f} GiB"
                  + ("" if covered else f"; THIS TORCH HAS NO KERNELS FOR sm_{major}{minor} (it has "
                                        f"{' '.join(arches)}): install a torch built for it"),
                  f"  backend auto -> {backend}; precision auto -> {describe_auto(device)[1]}",
                  f"  attention: {ops.describe_attention('fused' if backend == 'fused' else 'reference', device)}; "
                  "LayerNorm, bias+GELU, MLM cross-entropy: " + ("Triton kernels" if backend == "fused" else "PyTorch")]
    return lines


# ---------------------------------------------------------------------- --check
def _check(name: str, run) -> tuple[str, bool]:
    """(line, passed) for one check: `run()` returns a short result, or raises."""
    try:
        return f"  ok    {name}: {run()}", True
    except Exception as err:  # noqa: BLE001  (reported, not raised: every check runs)
        return f"  FAIL  {name}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", False


def _adam(device: torch.device) -> str:
    """One FusedAdam step against torch.optim.AdamW's on the same gradients."""
    from .optim import FusedAdam

    torch.manual_seed(0)
    ours = torch.randn(1000, device=device, requires_grad=True)
    theirs = ours.detach().clone().requires_grad_()
    grad = torch.randn(1000, device=device)
    opts = [FusedAdam([ours], lr=1e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01),
            torch.optim.AdamW([theirs], lr=1e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)]
    for p, opt in zip((ours, theirs), opts):
        p.grad = grad.clone()
        opt.step()
    diff = (ours - theirs).abs().max().item()
    if not diff <= 1e-6:
        raise AssertionError(f"max |difference| to torch.optim.AdamW {diff:.2e} (> 1e-6)")
    return f"max |difference| to torch.optim.AdamW {diff:.1e}"


def _masking(device: torch.device) -> str:
    """Dynamic masking selects about 15% of the tokens and never a special one."""
    from .masking import mask_tokens

    ids = torch.randint(4, 1000, (64, 128), device=device)
    ids[:, 0], ids[:, -1] = 0, 2  # <s> ... </s>
    _, labels = mask_tokens(ids, seed=0, step=0, vocab_size=1000)
    share = (labels != -100).float().mean().item()
    if not 0.12 < share < 0.18 or (labels[:, [0, -1]] != -100).any():
        raise AssertionError(f"{share:.1%} of the tokens selected, or a special token among them")
    return f"{share:.1%} of the tokens selected"


def _model(device: torch.device, precision: str, quantized: bool = False) -> str:
    """A tiny model's MLM loss (and, but for int8, its backward) on the fast path against the reference."""
    import copy

    from .config import RobertaConfig
    from .model import RobertaForMaskedLM
    from .precision import autocast

    cfg = RobertaConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=256, max_position_embeddings=130, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    reference = RobertaForMaskedLM(cfg, backend="reference").to(device)
    if quantized:
        from .quantization import quantize

        fast = quantize(copy.deepcopy(reference))
    else:
        fast = copy.deepcopy(reference)
        fast.backend = "fused" if device.type == "cuda" else "reference"
    ids = torch.randint(4, 512, (4, 128), device=device)
    mask = torch.ones_like(ids)
    mask[1, 100:] = 0  # a padded row
    labels = torch.where(torch.rand(ids.shape, device=device) < 0.15, ids, -100)
    losses = []
    for model in (reference, fast):
        with autocast(precision, device), torch.inference_mode(quantized):
            loss = model(ids, attention_mask=mask, labels=labels).loss
        if not quantized:
            loss.backward()
        losses.append(loss.float().item())
    diff = abs(losses[0] - losses[1]) / abs(losses[0])
    tolerance = 1e-2 if quantized or precision != "fp32" else 1e-5
    if not diff <= tolerance:
        raise AssertionError(f"loss {losses[1]:.5f} against the reference's {losses[0]:.5f}")
    grads = "" if quantized else ", gradients finite" if all(
        p.grad is None or torch.isfinite(p.grad).all() for p in fast.parameters()) else None
    if grads is None:
        raise AssertionError("non-finite gradients")
    return f"loss {losses[1]:.5f}, reference {losses[0]:.5f} (relative difference {diff:.1e}){grads}"


def checks() -> tuple[list[str], bool]:
    from .precision import describe_auto

    cpu_ = torch.device("cpu")
    runs = [("FusedAdam (CPU)", lambda: _adam(cpu_)), ("mask_tokens (CPU)", lambda: _masking(cpu_)),
            ("int8 model, rf.quantize (CPU)", lambda: _model(cpu_, "fp32", quantized=True))]
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        gpu = torch.device("cuda", i)
        precision = describe_auto(gpu)[0]
        runs += [(f"FusedAdam (cuda:{i})", lambda gpu=gpu: _adam(gpu)),
                 (f"mask_tokens (cuda:{i})", lambda gpu=gpu: _masking(gpu)),
                 (f"fused model, {precision} (cuda:{i})", lambda gpu=gpu, p=precision: _model(gpu, p))]
    results = [_check(name, run) for name, run in runs]
    return [line for line, _ in results], all(ok for _, ok in results)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roberta_fast.info", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="also run each fast path once on tiny inputs "
                        "against its reference (status 1 on a failure)")
    args = parser.parse_args(argv)
    print("\n".join(versions() + [extension()] + cpu() + gpus()))
    if not args.check:
        return 0
    lines, passed = checks()
    print("checks:\n" + "\n".join(lines))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
