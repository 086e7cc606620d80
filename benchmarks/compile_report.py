"""Compile the Triton kernels for GPUs ahead of time, on any machine, and report their resources.

Why: on a machine without a GPU the kernels only ever run in Triton's interpreter,
which accepts code the GPU compiler rejects and says nothing about registers. This
tool compiles what a GPU run would compile -- the same launch code with the same
arguments (so the same specialisation), and every autotune config of the attention
kernels -- for sm_80 / sm_90 with Triton's bundled ptxas, and reports per kernel and
config: registers, spill bytes, stack and shared memory. No GPU is needed and
nothing is launched. A config that spills registers will be slow; one that fails to
compile breaks autotuning on the GPU.

    python benchmarks/compile_report.py                     # the model's variants, sm_90
    python benchmarks/compile_report.py --arch 80 90 --dtypes fp16 bf16 fp32 --head-dims 32 64 128
    python benchmarks/compile_report.py --default-configs --json report.json

How: a stand-in Triton driver names the target GPU, and Triton's `jit_cache_hook`
records each launch's specialisation instead of compiling and launching it; the
records are then compiled with `triton.compile` for each architecture. Launch
geometry that depends on the GPU (tile shapes, the SM count) is computed as on a
CUDA device. Run it in a fresh process without TRITON_INTERPRET=1. Exit status 1
when any variant fails to compile.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SM_COUNT = {80: 108, 90: 132}  # A100, H100 SXM: sets the persistent grids of the row reductions
MAX_SHARED = {80: 166912, 90: 232448}  # bytes of shared memory one block may use (opt-in maximum)
ROWS = 32 * 512  # LayerNorm / bias+GELU rows: batch 32 x seqlen 512 (the benchmark shape)


@dataclass
class Launch:
    """One kernel specialisation as a GPU launch would compile it."""
    module: str  # e.g. roberta_fast.kernels.attention
    kernel: str  # the @triton.jit function's name in that module
    case: str  # what launched it, e.g. "attention fwd bf16 d64 mask+dropout"
    signature: dict
    constants: dict  # {(arg index,): value}
    attrs: dict
    num_warps: int
    num_stages: int


@dataclass
class Row:
    case: str
    kernel: str
    config: str  # BLOCK sizes, warps, stages
    arch: int
    status: str = "ok"  # ok | error
    registers: int | None = None
    spill_bytes: int | None = None  # spill stores + spill loads
    stack_bytes: int | None = None
    shared_bytes: int | None = None
    error: str | None = None


# ----------------------------------------------------------------------------- capture
class _StandInDriver:
    """Just enough of a Triton driver to specialise launches for `target` with no GPU present."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def _recording(arch: int, into: list):
    """Inside: every Triton launch is recorded into `into` (as (fn, compile kwargs)), not run."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    def hook(*, fn, compile, **_):
        into.append((fn.jit_function, compile))
        return True  # skip the compile and the launch

    driver = triton.runtime.driver
    old_driver = driver._active  # None without a GPU (reset_active() would look for one and fail)
    old_hook, old_autotune = knobs.runtime.jit_cache_hook, os.environ.get("ROBERTA_FAST_AUTOTUNE")
    driver.set_active(_StandInDriver(GPUTarget("cuda", arch, 32)))
    knobs.runtime.jit_cache_hook = hook
    os.environ["ROBERTA_FAST_AUTOTUNE"] = "0"  # the raw kernels; their configs are expanded below
    try:
        with _cuda_launch_geometry(SM_COUNT[arch]):
            yield
    finally:
        knobs.runtime.jit_cache_hook = old_hook
        driver.set_active(old_driver)
        if old_autotune is None:
            os.environ.pop("ROBERTA_FAST_AUTOTUNE", None)
        else:
            os.environ["ROBERTA_FAST_AUTOTUNE"] = old_autotune


@contextlib.contextmanager
def _cuda_launch_geometry(sm_count: int):
    """Make the row kernels' launchers pick the tiles and grids they pick for CUDA tensors."""
    from unittest import mock

    from roberta_fast.kernels import _utils

    cuda = torch.device("cuda")

    def tile_shape(n_cols, n_rows, device, max_cols):
        return _utils.tile_shape(n_cols, n_rows, cuda, max_cols)

    def num_programs(device):
        return 4 * sm_count  # _utils.num_programs on a CUDA device

    with contextlib.ExitStack() as stack:
        for name in ("bias_gelu", "layer_norm"):
            module = importlib.import_module(f"roberta_fast.kernels.{name}")
            stack.enter_context(mock.patch.object(module, "tile_shape", tile_shape))
            stack.enter_context(mock.patch.object(module, "num_programs", num_programs))
        cross_entropy = importlib.import_module("roberta_fast.kernels.cross_entropy")
        launch_shape = cross_entropy._launch_shape
        stack.enter_context(mock.patch.object(cross_entropy, "_launch_shape",
                                              lambda vocab, device: launch_shape(vocab, cuda)))
        yield


def _attention_cases(dtypes, head_dims, all_variants: bool):
    """(case name, thunk) running the attention launchers as the model calls them."""
    attn = importlib.import_module("roberta_fast.kernels.attention")
    batch, seqlen, nheads = 2, 512, 12
    # (mask, varlen, dropout): training with padding, packed (varlen) and full rows; eval
    variants = [(True, False, True), (False, True, True), (False, False, True), (True, False, False),
                (False, True, False)]
    if all_variants:
        variants += [(False, False, False)]
    for name, dtype in dtypes.items():
        for head_dim in head_dims:
            for has_mask, varlen, dropout in variants:
                label = "+".join(n for n, on in (("mask", has_mask), ("varlen", varlen), ("dropout", dropout)) if on)
                case = f"attention {name} d{head_dim} {label or 'plain'}"
                lead = (batch * seqlen,) if varlen else (batch, seqlen)
                # q, k, v: views of the fused qkv projection (..., 3, heads, head_dim), as in the model
                q, k, v = torch.empty(*lead, 3, nheads, head_dim, dtype=dtype).unbind(-3)
                mask = torch.ones(batch, seqlen, dtype=torch.uint8) if has_mask else None
                cu = torch.arange(0, batch * seqlen + 1, seqlen, dtype=torch.int32) if varlen else None
                rng = torch.zeros(2, dtype=torch.int64) if dropout else None
                p, scale = (0.1 if dropout else 0.0), head_dim ** -0.5
                out = torch.empty(q.shape, dtype=dtype)
                lse = torch.empty((nheads, batch * seqlen) if varlen else (batch, nheads, seqlen))

                def run(q=q, k=k, v=v, mask=mask, cu=cu, rng=rng, p=p, scale=scale, out=out, lse=lse,
                        train=dropout):
                    attn._forward(q, k, v, mask, cu, seqlen, rng, p, scale)
                    if train:  # dq, dk, dv: slices of one dqkv, as attention_qkvpacked writes them
                        dqkv = torch.empty(*lead, 3, nheads, head_dim, dtype=dtype)
                        attn._backward(torch.empty(out.shape, dtype=out.dtype), q, k, v, out, lse, mask, cu,
                                       seqlen, rng, p, scale, grads=dqkv.unbind(-3))
                yield case, run


def _row_kernel_cases(dtypes, hidden_sizes):
    """bias+GELU, residual+LayerNorm and the MLM loss as the model calls them under autocast
    (fp32 weights)."""
    bias_gelu = importlib.import_module("roberta_fast.kernels.bias_gelu")
    layer_norm = importlib.import_module("roberta_fast.kernels.layer_norm")
    cross_entropy = importlib.import_module("roberta_fast.kernels.cross_entropy")
    for name, dtype in dtypes.items():
        def loss(dtype=dtype, vocab=50265):
            logits, target = torch.empty(ROWS, vocab, dtype=dtype), torch.zeros(ROWS, dtype=torch.int64)
            _, lse = cross_entropy._cross_entropy_fwd(logits, target, -100)
            cross_entropy._cross_entropy_bwd(torch.empty(ROWS), logits, target, lse, -100)
        yield f"cross_entropy {name} vocab 50265", loss

        for hidden in hidden_sizes:
            def gelu(dtype=dtype, n=4 * hidden):
                x, bias = torch.empty(ROWS, n, dtype=dtype), torch.empty(n)
                bias_gelu._bias_gelu_fwd(x, bias)
                bias_gelu._bias_gelu_bwd(torch.empty_like(x), x, bias)
            yield f"bias_gelu {name} n{4 * hidden}", gelu

            # (residual, dropout, half copy of y): the sublayer ends (fp32 residual stream; under
            # autocast the model's LayerNorms also write the next matmul's copy) and the embeddings' LN
            for has_residual, p, copy in ((True, 0.1, True), (True, 0.1, False), (True, 0.0, False),
                                          (False, 0.0, False)):
                def ln(dtype=dtype, n=hidden, has_residual=has_residual, p=p, copy=copy):
                    x, w, b = torch.empty(ROWS, n, dtype=dtype), torch.empty(n), torch.empty(n)
                    r = torch.empty(ROWS, n) if has_residual else None
                    seed = torch.zeros(2, dtype=torch.int64) if p else None
                    layer_norm._layer_norm_fwd(x, w, b, r, seed, 1e-5, p, False, dtype if copy else None)
                    stats = torch.empty(ROWS)
                    dy_copy = torch.empty(ROWS, n, dtype=dtype) if copy else None
                    layer_norm._layer_norm_bwd(torch.empty(ROWS, n), dy_copy, x, w, r, stats, stats, seed, p)
                label = ("residual" if has_residual else "") + ("+dropout" if p else "") + ("+copy" if copy else "")
                yield f"layer_norm {name} n{hidden} {label or 'plain'}", ln


def capture(arch, dtypes, head_dims, hidden_sizes, all_variants=False) -> list[Launch]:
    """Every distinct kernel specialisation the launchers compile for these cases."""
    launches, seen = [], set()
    cases = [*_attention_cases(dtypes, head_dims, all_variants), *_row_kernel_cases(dtypes, hidden_sizes)]
    for case, run in cases:
        records = []
        with _recording(arch, records):
            run()
        for fn, c in records:
            launch = Launch(fn.__module__, fn.__name__, case, dict(c["signature"]), dict(c["constants"]),
                            dict(c["configs"][0]), c["num_warps"], c["num_stages"])
            key = (launch.kernel, repr(launch.signature), repr(launch.constants), repr(launch.attrs),
                   launch.num_warps, launch.num_stages)
            if key not in seen:
                seen.add(key)
                launches.append(launch)
    return launches


def config_variants(launch: Launch) -> list[Launch]:
    """An attention launch once per autotune config, in list order (as autotuning compiles them); others as is."""
    attn = importlib.import_module("roberta_fast.kernels.attention")
    configs = {kernel.__name__: configs for kernel, configs in attn._KERNELS.values()}.get(launch.kernel)
    if configs is None:
        return [launch]
    fn = getattr(attn, launch.kernel)
    variants = []
    for config in configs:
        constants = dict(launch.constants)
        for meta, value in config.kwargs.items():
            constants[(fn.arg_names.index(meta),)] = value
        variants.append(Launch(launch.module, launch.kernel, launch.case, launch.signature, constants, launch.attrs,
                               config.num_warps, config.num_stages))
    return variants


# ----------------------------------------------------------------------------- compile
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame")


def _config_label(launch: Launch, fn) -> str:
    blocks = [f"{name}={launch.constants[(i,)]}" for i, name in enumerate(fn.arg_names)
              if name.startswith("BLOCK") and (i,) in launch.constants]
    return " ".join(blocks + [f"w{launch.num_warps}", f"s{launch.num_stages}"])


def compile_one(launch: Launch, arch: int) -> Row:
    """Compile one launch for sm_<arch> and read ptxas's resource report."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch.module), launch.kernel)
    row = Row(launch.case, launch.kernel, _config_label(launch, fn), arch)
    log = io.StringIO()
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report is printed; collect it
    knobs.compilation.always_compile = True  # a cache hit would skip ptxas and its report
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, launch.signature, launch.constants, launch.attrs),
                                    target=GPUTarget("cuda", arch, 32),
                                    options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    except Exception as err:  # the point is to report it, with the variant that failed
        row.status, row.error = "error", f"{type(err).__name__}: {str(err).strip()[:2000]}"
        return row
    text = log.getvalue()
    if m := _PTXAS_USED.search(text):
        row.registers = int(m.group(1))
    if m := _PTXAS_SPILL.search(text):
        row.spill_bytes = int(m.group(1)) + int(m.group(2))
    if m := _PTXAS_STACK.search(text):
        row.stack_bytes = int(m.group(1))
    row.shared_bytes = kernel.metadata.shared
    return row


def default_config(launch: Launch, arch: int) -> Row:
    """What runs with autotuning off: the first config that compiles and fits the shared memory."""
    for variant in config_variants(launch):
        row = compile_one(variant, arch)
        if row.status == "ok" and not _too_much_shared(row):
            return row
    return row  # none fits: the last one, flagged


def _compile_job(args):
    fn, launch, arch = args
    return fn(launch, arch)


def compile_all(launches: list[Launch], archs, jobs: int, default_configs: bool) -> list[Row]:
    """Every config of every launch for each arch, or only the config that runs without autotuning."""
    if default_configs:
        work = [(default_config, launch, arch) for arch in archs for launch in launches]
    else:
        work = [(compile_one, variant, arch) for arch in archs for launch in launches
                for variant in config_variants(launch)]
    if jobs <= 1:
        return [_compile_job(w) for w in work]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_compile_job, work, chunksize=2))


# ----------------------------------------------------------------------------- report
def format_table(rows: list[Row]) -> str:
    header = f"{'case':<40} {'kernel':<28} {'config':<26} {'sm':>3} {'regs':>4} {'spill':>6} {'smem':>7}  note"
    lines = [header, "-" * len(header)]
    for r in rows:
        if r.status != "ok":
            lines.append(f"{r.case:<40} {r.kernel:<28} {r.config:<26} {r.arch:>3}  ERROR {r.error.splitlines()[0]}")
            continue
        note = " ".join(n for n, bad in (("SPILLS", r.spill_bytes), ("TOO-MUCH-SHARED", _too_much_shared(r)))
                        if bad)
        lines.append(f"{r.case:<40} {r.kernel:<28} {r.config:<26} {r.arch:>3} {r.registers or '?':>4} "
                     f"{r.spill_bytes if r.spill_bytes is not None else '?':>6} {r.shared_bytes:>7}  {note}")
    return "\n".join(lines)


def _too_much_shared(row: Row) -> bool:
    """Compiles, but cannot launch: Triton raises OutOfResources (autotuning skips such a config)."""
    return row.shared_bytes is not None and row.shared_bytes > MAX_SHARED[row.arch]


def summary(rows: list[Row]) -> str:
    errors = sum(r.status != "ok" for r in rows)
    spilling = sum(bool(r.spill_bytes) for r in rows)
    too_big = sum(_too_much_shared(r) for r in rows)
    return (f"{len(rows)} compiled variants: {errors} failed to compile, {spilling} spill registers, "
            f"{too_big} need more shared memory than a block may have")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=[90], choices=sorted(SM_COUNT),
                   help="compute capabilities to compile for (80: A100, 90: H100/H200)")
    p.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=sorted(DTYPES),
                   help="activation dtypes (the model trains under fp16 or bf16 autocast)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64], choices=[32, 64, 128])
    p.add_argument("--hidden-sizes", type=int, nargs="+", default=[768], help="LayerNorm widths (GELU: 4x)")
    p.add_argument("--all-variants", action="store_true", help="also attention with neither mask nor dropout")
    p.add_argument("--default-configs", action="store_true",
                   help="only what runs with ROBERTA_FAST_AUTOTUNE=0: each attention kernel's first config that "
                        "fits the GPU's shared memory")
    p.add_argument("--kernels", nargs="+", help="only kernels whose name contains one of these strings")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    p.add_argument("--json", metavar="PATH", help="also write every row to this JSON file")
    p.add_argument("--errors-only", action="store_true",
                   help="print only the variants that failed, spill or need too much shared memory")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_report: TRITON_INTERPRET=1 is set, so the kernels are interpreted, not compiled; "
              "run without it", file=sys.stderr)
        return 2
    import triton
    if not hasattr(triton, "knobs"):
        print(f"compile_report: needs Triton >= 3.4 (it hooks the compiler through triton.knobs); this is "
              f"Triton {triton.__version__}", file=sys.stderr)
        return 2
    dtypes = {name: DTYPES[name] for name in args.dtypes}
    launches = capture(args.arch[0], dtypes, args.head_dims, args.hidden_sizes, args.all_variants)
    if args.kernels:
        launches = [la for la in launches if any(s in la.kernel for s in args.kernels)]
    rows = compile_all(launches, args.arch, args.jobs, args.default_configs)
    shown = [r for r in rows if r.status != "ok" or r.spill_bytes or _too_much_shared(r)] if args.errors_only \
        else rows
    print(format_table(shown))
    print(summary(rows))
    if args.json:
        report = {"triton": triton.__version__, "torch": torch.__version__, "argv": sys.argv,
                  "rows": [asdict(r) for r in rows]}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if any(r.status != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
