"""Compile the Triton kernels for GPUs ahead of time, on any machine, and report their resources.

Why: on a machine without a GPU the kernels only ever run in Triton's interpreter,
which accepts code the GPU compiler rejects and says nothing about registers or
tensor cores. This tool compiles what a GPU run would compile -- the same launch
code with the same arguments (so the same specialisation), and every autotune config
of the attention kernels -- for sm_70 / sm_75 / sm_80 / sm_90 (V100, T4, A100, H100)
with Triton's bundled ptxas, and reports per kernel and config: registers, spill
bytes, stack and shared memory, the kernel's dots (`tt.dot` in its Triton IR) and
its PTX's tensor-core (`mma`, `wgmma`) and `fma` instructions, and whether the fused
backend launches it on that GPU (`roberta_fast.ops.attention_impl` decides for the
attention kernels: not below sm_80, where Triton >= 3.2 lowers tl.dot to FMA; the
element-wise kernels run on every CUDA GPU). No GPU is needed and nothing is launched.

Exit status 1 when a variant fails to compile, or when a kernel the backend launches
on a GPU does matrix work there without tensor-core instructions, spills registers or
needs more shared memory than a block may have -- in every config autotuning may pick
for that launch. With `--default-configs` the config that runs with autotuning off
is compiled first, and only where it has such a problem the launch's other configs
too (its spill then shows as a note, and fails only if no candidate is clean). fp16 is
compiled for every architecture, bf16 only for sm_80+ (below, `--precision auto` is fp16).

    python benchmarks/compile_report.py                     # the model's variants, all four GPUs
    python benchmarks/compile_report.py --arch 80 90 --dtypes fp16 bf16 fp32 --head-dims 32 64 128
    python benchmarks/compile_report.py --default-configs --launched-only   # what CI checks

How: a stand-in Triton driver names the target GPU, and Triton's `jit_cache_hook`
records each launch's specialisation instead of compiling and launching it; the
records are then compiled with `triton.compile` for each architecture. Launch
geometry that depends on the GPU (tile shapes, the SM count) is computed as on a
CUDA device. Run it in a fresh process without TRITON_INTERPRET=1.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
# V100, T4, A100, H100 SXM: the SM count sets the persistent grids of the row reductions
SM_COUNT = {70: 80, 75: 40, 80: 108, 90: 132}
MAX_SHARED = {70: 98304, 75: 65536, 80: 166912, 90: 232448}  # bytes one block may use (opt-in maximum)
BF16_MIN_ARCH = 80  # no bf16 below sm_80: the model trains in fp16 there
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
    enable_fp_fusion: bool  # as the launch resolved it (the launchers pass kernels.LAUNCH_OPTIONS)


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
    dots: int | None = None  # tt.dot in the Triton IR: the kernel's matrix work
    mma: int | None = None  # tensor-core instructions in the PTX (mma.sync; wgmma on sm_90)
    wgmma: int | None = None
    fma: int | None = None  # fma.rn: what a dot becomes without tensor cores
    launched: bool = True  # the fused backend launches this kernel on this GPU
    launch_id: int = 0  # rows of one launch (its autotune configs) share it
    default: bool = True  # what runs with autotuning off (False: another autotune candidate)
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

    def tile_shape(n_cols, n_rows, device, *args, **kwargs):
        return _utils.tile_shape(n_cols, n_rows, cuda, *args, **kwargs)

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


def _attention_cases(dtypes, head_dims):
    """(case name, thunk) running the attention launchers as the model calls them."""
    attn = importlib.import_module("roberta_fast.kernels.attention")
    batch, seqlen, nheads = 2, 512, 12
    # (mask, varlen, dropout): training with padding, packed (varlen) and full rows; eval the same,
    # and eval without padding (no mask, no varlen: every unpadded inference batch)
    variants = [(True, False, True), (False, True, True), (False, False, True), (True, False, False),
                (False, True, False), (False, False, False)]
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


def capture(arch, dtypes, head_dims, hidden_sizes) -> list[Launch]:
    """Every distinct kernel specialisation the launchers compile for these cases."""
    launches, seen = [], set()
    cases = [*_attention_cases(dtypes, head_dims), *_row_kernel_cases(dtypes, hidden_sizes)]
    for case, run in cases:
        records = []
        with _recording(arch, records):
            run()
        for fn, c in records:
            launch = Launch(fn.__module__, fn.__name__, case, dict(c["signature"]), dict(c["constants"]),
                            dict(c["configs"][0]), c["num_warps"], c["num_stages"],
                            c["enable_fp_fusion"])
            key = (launch.kernel, repr(launch.signature), repr(launch.constants), repr(launch.attrs),
                   launch.num_warps, launch.num_stages)
            if key not in seen:
                seen.add(key)
                launches.append(launch)
    return launches


def config_variants(launch: Launch, autotune_off: bool = False) -> list[Launch]:
    """An attention launch once per autotune config, in list order (as autotuning compiles them), or
    in the order autotuning-off tries them (attention.default_order: the head dim's default first);
    others as is."""
    attn = importlib.import_module("roberta_fast.kernels.attention")
    names = {kernel.__name__: name for name, (kernel, _) in attn._KERNELS.items()}
    if launch.kernel not in names:
        return [launch]
    fn = getattr(attn, launch.kernel)
    name = names[launch.kernel]
    head_dim = launch.constants[(fn.arg_names.index("HEAD_DIM"),)]
    configs = attn.default_order(name, head_dim) if autotune_off else attn._KERNELS[name][1]
    variants = []
    for config in configs:
        constants = dict(launch.constants)
        for meta, value in config.kwargs.items():
            constants[(fn.arg_names.index(meta),)] = value
        variants.append(dataclasses.replace(launch, constants=constants, num_warps=config.num_warps,
                                            num_stages=config.num_stages))
    return variants


# ----------------------------------------------------------------------------- compile
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame")
_DOT = re.compile(r"\btt\.dot\b")  # TTIR; tt.dot_scaled is not used
_MMA = re.compile(r"^\s*(?:@!?%p\d+\s+)?mma\.", re.M)  # PTX instructions, predicated or not
_WGMMA = re.compile(r"^\s*(?:@!?%p\d+\s+)?wgmma\.mma_async", re.M)
_FMA = re.compile(r"^\s*(?:@!?%p\d+\s+)?fma\.rn", re.M)


def launched(launch: Launch, arch: int) -> bool:
    """Whether the fused backend launches this kernel on a CUDA GPU of compute capability sm_<arch>:
    ops.attention_impl decides for the attention kernels, with the device's capability faked."""
    if launch.module.rsplit(".", 1)[-1] != "attention":
        return True  # the element-wise kernels run on every CUDA GPU
    from unittest import mock

    from roberta_fast import ops

    with mock.patch.object(ops, "device_capability", lambda device: divmod(arch, 10)):
        return ops.attention_impl(torch.device("cuda")) == "triton"


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
                                    options={"num_warps": launch.num_warps, "num_stages": launch.num_stages,
                                             "enable_fp_fusion": launch.enable_fp_fusion})
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
    row.dots = len(_DOT.findall(kernel.asm["ttir"]))
    ptx = kernel.asm["ptx"]
    row.mma, row.wgmma, row.fma = (len(pattern.findall(ptx)) for pattern in (_MMA, _WGMMA, _FMA))
    return row


def default_config(launch: Launch, arch: int) -> Row:
    """What runs with autotuning off: the head dim's default, or the first config after it that
    compiles and fits the shared memory."""
    for variant in config_variants(launch, autotune_off=True):
        row = compile_one(variant, arch)
        if row.status == "ok" and not _too_much_shared(row):
            return row
    return row  # none fits: the last one, flagged


def _compile_job(args):
    fn, launch, arch, launch_id = args
    row = fn(launch, arch)
    row.launch_id = launch_id
    return row


def _run_jobs(work, jobs: int) -> list[Row]:
    if jobs <= 1:
        return [_compile_job(w) for w in work]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_compile_job, work, chunksize=2))


def compile_all(launches: list[tuple[int, Launch]], jobs: int, default_configs: bool,
                launched_only: bool = False) -> list[Row]:
    """Compile each (arch, launch): every config, or the one that runs without autotuning
    (default_configs) -- and where that one has a problem on a GPU that launches it, the
    launch's other configs too, the candidates autotuning (on by default) chooses among.
    With launched_only, a kernel the backend does not launch on that GPU gets an uncompiled row."""
    work, rows = [], []
    for launch_id, (arch, launch) in enumerate(launches):
        if launched_only and not launched(launch, arch):
            rows.append(Row(launch.case, launch.kernel, "-", arch, "not compiled", launched=False,
                            launch_id=launch_id))
            continue
        variants = [launch] if default_configs else config_variants(launch)
        work += [(default_config if default_configs else compile_one, v, arch, launch_id) for v in variants]
    compiled = _run_jobs(work, jobs)
    for row in compiled:
        row.launched = launched(launches[row.launch_id][1], row.arch)
    if default_configs:
        flawed = {r.launch_id: r.config for r in compiled if r.launched and problems(r)}
        again = [(compile_one, v, launches[i][0], i) for i in flawed for v in config_variants(launches[i][1])]
        for row in _run_jobs(again, jobs):
            if row.config != flawed[row.launch_id]:
                row.launched, row.default = True, False
                compiled.append(row)
    return sorted(rows + compiled, key=lambda r: (r.launch_id, not r.default))


# ----------------------------------------------------------------------------- report
def _too_much_shared(row: Row) -> bool:
    """Compiles, but cannot launch: Triton raises OutOfResources (autotuning skips such a config)."""
    return row.shared_bytes is not None and row.shared_bytes > MAX_SHARED[row.arch]


def problems(row: Row) -> list[str]:
    """What stops this compiled variant from running well where the backend launches it."""
    if row.status != "ok":
        return ["ERROR"] if row.status == "error" else []
    found = [name for name, bad in (
        ("NO-TENSOR-CORES", row.dots and not (row.mma or row.wgmma)),
        ("SPILLS", row.spill_bytes),
        ("TOO-MUCH-SHARED", _too_much_shared(row))) if bad]
    return found if row.launched else [name.lower() for name in found]  # not launched: noted, not failed


def failures(rows: list[Row]) -> list[Row]:
    """Variants that fail the report: a compile error anywhere; where the backend launches a kernel,
    a launch none of whose compiled configs is free of problems (its last config stands for it)."""
    failed = [r for r in rows if r.status == "error"]
    by_launch = {}
    for r in rows:
        if r.status == "ok" and r.launched:
            by_launch.setdefault(r.launch_id, []).append(r)
    for configs in by_launch.values():
        if all(problems(r) for r in configs):
            failed.append(configs[-1])
    return failed


def format_table(rows: list[Row]) -> str:
    header = (f"{'case':<40} {'kernel':<28} {'config':<26} {'sm':>3} {'run':>3} {'regs':>4} {'spill':>6} "
              f"{'smem':>7} {'dot':>3} {'mma':>5} {'wgmma':>5} {'fma':>6}  note")
    lines = [header, "-" * len(header)]
    for r in rows:
        head = f"{r.case:<40} {r.kernel:<28} {r.config:<26} {r.arch:>3} {'yes' if r.launched else 'no':>3}"
        if r.status == "error":
            lines.append(f"{head}  ERROR {r.error.splitlines()[0]}")
        elif r.status != "ok":
            lines.append(f"{head}  {r.status} (the backend does not launch it on sm_{r.arch})")
        else:
            value = lambda v: "?" if v is None else v  # noqa: E731
            lines.append(f"{head} {value(r.registers):>4} {value(r.spill_bytes):>6} {r.shared_bytes:>7} "
                         f"{r.dots:>3} {r.mma:>5} {r.wgmma:>5} {r.fma:>6}  "
                         + " ".join(problems(r) + ([] if r.default else ["(autotune candidate)"])))
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    compiled = [r for r in rows if r.status != "not compiled"]
    errors = sum(r.status == "error" for r in rows)
    launched_rows = [r for r in compiled if r.launched and r.status == "ok"]
    counts = {name: sum(name in problems(r) for r in launched_rows)
              for name in ("NO-TENSOR-CORES", "SPILLS", "TOO-MUCH-SHARED")}
    return (f"{len(compiled)} compiled variants, {errors} failed to compile; of the {len(launched_rows)} the "
            f"backend launches: {counts['NO-TENSOR-CORES']} do matrix work without tensor cores, "
            f"{counts['SPILLS']} spill registers, {counts['TOO-MUCH-SHARED']} need more shared memory than a "
            f"block may have; {len(failures(rows))} failures")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=sorted(SM_COUNT), choices=sorted(SM_COUNT),
                   help="compute capabilities to compile for (70: V100, 75: T4, 80: A100, 90: H100/H200)")
    p.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=sorted(DTYPES),
                   help="activation dtypes (the model trains under fp16 or bf16 autocast); bf16 only on sm_80+")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=[32, 64, 128])
    p.add_argument("--hidden-sizes", type=int, nargs="+", default=[768], help="LayerNorm widths (GELU: 4x)")
    p.add_argument("--default-configs", action="store_true",
                   help="only what runs with ROBERTA_FAST_AUTOTUNE=0: each attention kernel's first config that "
                        "fits the GPU's shared memory")
    p.add_argument("--launched-only", action="store_true",
                   help="compile only the kernels the backend launches on each GPU (e.g. no Triton attention "
                        "below sm_80)")
    p.add_argument("--kernels", nargs="+", help="only kernels whose name contains one of these strings")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    p.add_argument("--json", metavar="PATH", help="also write every row to this JSON file")
    p.add_argument("--errors-only", action="store_true",
                   help="print only the variants with a problem (compile error, no tensor cores, spills, "
                        "too much shared memory)")
    return p.parse_args(argv)


def triton_cannot_report() -> str | None:
    """Why the installed Triton cannot make this report (None if it can): the report hooks the compiler
    through triton.knobs and reads ptxas's report through knobs.nvidia.dump_ptxas_log (Triton >= 3.5)."""
    import triton

    if hasattr(triton, "knobs") and hasattr(triton.knobs.nvidia, "dump_ptxas_log"):
        return None
    return (f"needs Triton >= 3.5 (it hooks the compiler through triton.knobs and reads ptxas's report "
            f"through knobs.nvidia.dump_ptxas_log); this is Triton {triton.__version__}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_report: TRITON_INTERPRET=1 is set, so the kernels are interpreted, not compiled; "
              "run without it", file=sys.stderr)
        return 2
    why = triton_cannot_report()
    if why:
        print(f"compile_report: {why}", file=sys.stderr)
        return 2
    import triton
    launches = []
    for arch in args.arch:
        dtypes = {name: DTYPES[name] for name in args.dtypes if name != "bf16" or arch >= BF16_MIN_ARCH}
        launches += [(arch, la) for la in capture(arch, dtypes, args.head_dims, args.hidden_sizes)
                     if not args.kernels or any(s in la.kernel for s in args.kernels)]
    rows = compile_all(launches, args.jobs, args.default_configs, args.launched_only)
    shown = [r for r in rows if problems(r)] if args.errors_only else rows
    print(format_table(shown))
    print(summary(rows))
    if args.json:
        report = {"triton": triton.__version__, "torch": torch.__version__, "argv": sys.argv,
                  "rows": [asdict(r) for r in rows]}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if failures(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
