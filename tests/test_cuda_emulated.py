"""The CUDA kernels of csrc/ run on the CPU, through a stand-in CUDA runtime, against the CPU ops.

No GPU is needed: tests/cuda_emu/cuda_runtime.h runs every CUDA thread of a block as a
std::thread (barriers for __syncthreads and the warp shuffles), and this file rewrites
each `kernel<<<...>>>(args);` launch into a call of it, then builds csrc/*.cu with g++.
So the launchers and kernels of fused_adam_cuda.cu, multi_tensor_apply.cuh and
mask_tokens_cuda.cu (chunking, ragged tails, the vectorised and unaligned paths, launch
splitting past 36 tensors and 320 blocks, block reductions, the overflow skip, the
at-least-one-prediction rule, per-span replacement and the span boundaries) execute for
real and must give what the CPU ops give:
bit for bit for Adam and masking, to float rounding for the norm (another summation
order). The last test runs them all again with the kernels built with AddressSanitizer,
which stops at any access past a tensor. What the emulation cannot check is the GPU's
own arithmetic (FMA, fast math) and races between blocks; tests/test_fused_adam.py and
test_mask_tokens.py do that on a GPU.
"""
import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from roberta_fast import _ext
from roberta_fast.masking import STRATEGIES, _arguments, _Rule, mask_tokens, no_pad_boundaries

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
EMU = Path(__file__).resolve().parent / "cuda_emu"
LAUNCH = re.compile(r"(\w+)<<<(.*?)>>>\((.*?)\);", re.S)
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # FloatType of fused_adam_cuda.h
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.98, eps=1e-6, weight_decay=0.01)
ASAN_SWITCH = "ROBERTA_FAST_EMULATE_WITH_ASAN"  # build the kernels with AddressSanitizer


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    """csrc/*.cu with launches rewritten for the stand-in runtime, built into a shared library."""
    out = tmp_path_factory.mktemp("cuda_emu")
    sources = []
    for path in [*CSRC.glob("*.cu"), *CSRC.glob("*.cuh")]:
        text, launches = LAUNCH.subn(r"::emu::launch(\2, [&] { \1(\3); });", path.read_text())
        assert "<<<" not in text, f"a launch in {path.name} was not rewritten"
        target = out / (path.stem + ".cpp" if path.suffix == ".cu" else path.name)
        target.write_text(text)
        if path.suffix == ".cu":
            sources.append(str(target))
    library = out / "libcuda_emu.so"
    compiler = shutil.which("g++") or shutil.which("c++")
    assert compiler, "a C++ compiler is needed (it also builds roberta_fast._C)"
    # ASan builds at -O1, as its documentation advises (and twice as fast to compile as -O2)
    sanitize = (["-O1", "-fsanitize=address", "-fno-omit-frame-pointer"] if os.environ.get(ASAN_SWITCH) == "1"
                else ["-O2"])
    # the compiler need not run under the sanitizer's preloaded runtime (measured: 43 s there, 25 s without)
    without_asan_runtime = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    build = subprocess.run([compiler, "-std=c++20", "-pthread", "-shared", "-fPIC", *sanitize,
                            f"-I{EMU}", f"-I{CSRC}", *sources, str(EMU / "glue.cpp"), "-o", str(library)],
                           capture_output=True, text=True, env=without_asan_runtime)
    assert build.returncode == 0, build.stderr[-6000:]
    lib = ctypes.CDLL(str(library))
    for name in ("emu_adam_step", "emu_adam_bump_steps", "emu_grad_sumsq_partials", "emu_sum_partials",
                 "emu_mask_tokens"):
        getattr(lib, name).restype = ctypes.c_char_p
    for name in ("emu_num_chunks", "emu_mask_params_size", "emu_mask_params_special_offset"):
        getattr(lib, name).restype = ctypes.c_int64
    lib.emu_num_chunks.argtypes = [ctypes.c_int64]
    return lib


def _ptrs(tensors):
    return (ctypes.c_void_p * max(len(tensors), 1))(*[t.data_ptr() for t in tensors])


def _ptr(t):
    return ctypes.c_void_p(None if t is None else t.data_ptr())


def _check(err):
    assert err is None, err.decode()


# ------------------------------------------------------------------------------ Adam
def emulated_grad_sumsq(emu, grads, grad_scale=None):
    """What fused_adam.cpp's CUDA branch of grad_sumsq does: partials per dtype, then their sum."""
    total = sum(emu.emu_num_chunks(g.numel()) for g in grads)
    partials = torch.zeros(max(total, 1))
    offset = 0
    for dtype, code in DTYPE_CODE.items():
        group = [g for g in grads if g.dtype == dtype and g.numel() > 0]
        if not group:
            continue
        sizes = (ctypes.c_int64 * len(group))(*[g.numel() for g in group])
        _check(emu.emu_grad_sumsq_partials(code, len(group), _ptrs(group), sizes, _ptr(grad_scale),
                                           ctypes.c_void_p(partials.data_ptr() + 4 * offset)))
        offset += sum(emu.emu_num_chunks(g.numel()) for g in group)
    out = torch.empty(())
    _check(emu.emu_sum_partials(_ptr(partials), ctypes.c_int64(partials.numel()), _ptr(out)))
    return out


def emulated_adam_step(emu, state, grad_scale=None, sumsq=None, max_norm=0.0):
    """What fused_adam.cpp's CUDA branch of adam_step does: one pass per (param, grad) dtype pair,
    then the step counts."""
    params, grads, m, v, masters, steps = (state[k] for k in ("params", "grads", "m", "v", "masters", "steps"))
    pairs = sorted({(p.dtype, g.dtype) for p, g in zip(params, grads)}, key=str)
    for p_dtype, g_dtype in pairs:
        idx = [i for i, (p, g) in enumerate(zip(params, grads))
               if (p.dtype, g.dtype) == (p_dtype, g_dtype) and p.numel() > 0]
        if not idx:
            continue
        pick = lambda ts: [ts[i] for i in idx]  # noqa: E731
        sizes = (ctypes.c_int64 * len(idx))(*[params[i].numel() for i in idx])
        _check(emu.emu_adam_step(
            DTYPE_CODE[p_dtype], DTYPE_CODE[g_dtype], len(idx), _ptrs(pick(params)), _ptrs(pick(grads)),
            _ptrs(pick(m)), _ptrs(pick(v)), _ptrs(pick(masters)) if masters else None, _ptrs(pick(steps)),
            sizes, *[ctypes.c_double(HYPER[k]) for k in ("lr", "beta1", "beta2", "eps", "weight_decay")],
            _ptr(grad_scale), _ptr(sumsq), ctypes.c_double(max_norm)))
    _check(emu.emu_adam_bump_steps(len(steps), _ptrs(steps), _ptr(sumsq)))


def cpu_adam_step(state, grad_scale=None, sumsq=None, max_norm=0.0):
    _ext.load().adam_step(state["params"], state["grads"], state["m"], state["v"], state["masters"],
                          state["steps"], *HYPER.values(), grad_scale, sumsq, max_norm)


def make_state(shapes, p_dtype, g_dtype, master, seed=0):
    """Parameters (some as views at odd offsets: the unaligned path), gradients, moments, steps."""
    gen = torch.Generator().manual_seed(seed)
    params, grads = [], []
    for i, n in enumerate(shapes):
        if i % 3 == 2 and n > 0:  # a view one element into its storage: not 16-byte aligned
            params.append(torch.randn(n + 1, generator=gen).to(p_dtype)[1:])
            grads.append(torch.randn(n + 1, generator=gen).to(g_dtype)[1:])
        else:
            params.append(torch.randn(n, generator=gen).to(p_dtype))
            grads.append(torch.randn(n, generator=gen).to(g_dtype))
    return {
        "params": params, "grads": grads,
        "m": [torch.randn(n, generator=gen) * 0.1 for n in shapes],
        "v": [torch.rand(n, generator=gen) * 0.1 for n in shapes],
        "masters": [p.float() + 1e-4 * torch.randn(p.shape, generator=gen) for p in params] if master else [],
        "steps": [torch.tensor(float(i % 4)) for i in range(len(shapes))],
    }


def clone_state(state):
    return {k: [t.clone() for t in v] for k, v in state.items()}


def assert_states_equal(got, want):
    for key in want:
        for i, (a, b) in enumerate(zip(got[key], want[key])):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{key}[{i}] differs"


# 1, 7: tails only; 65536 + 5: two chunks, the second ragged; 0: skipped; 4002: tail of 2
SHAPES = [1, 7, 65536 + 5, 0, 4002, 33, 130]


@pytest.mark.parametrize("p_dtype, g_dtype, master", [
    (torch.float32, torch.float32, False), (torch.float16, torch.float16, True),
    (torch.bfloat16, torch.float32, True), (torch.float32, torch.bfloat16, False),
    (torch.bfloat16, torch.bfloat16, False)])
def test_adam_step_matches_the_cpu_op(emu, p_dtype, g_dtype, master):
    state = make_state(SHAPES, p_dtype, g_dtype, master)
    want = clone_state(state)
    scale, norm_kwargs = torch.tensor(4.0), dict(max_norm=5.0)
    sumsq = emulated_grad_sumsq(emu, state["grads"], scale)
    emulated_adam_step(emu, state, scale, sumsq, **norm_kwargs)
    cpu_adam_step(want, scale, sumsq, **norm_kwargs)
    assert_states_equal(state, want)
    assert [float(s) for s in state["steps"]] == [i % 4 + 1.0 for i in range(len(SHAPES))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_grad_sumsq_matches_the_cpu_op(emu, dtype):
    grads = make_state(SHAPES, torch.float32, dtype, False)["grads"]
    scale = torch.tensor(8.0)
    got = emulated_grad_sumsq(emu, grads, scale)
    want = _ext.load().grad_sumsq(grads, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_many_tensors_in_several_launches_and_an_inf_in_the_last(emu):
    """100 tensors (36 per Adam launch, 96 per norm launch); an inf in the last gradient
    alone must make the norm inf and skip the whole step; without it, the CPU op's result."""
    shapes = [5 + i % 9 for i in range(100)]
    state = make_state(shapes, torch.float32, torch.float16, False, seed=1)
    want = clone_state(state)
    sumsq = emulated_grad_sumsq(emu, state["grads"])
    emulated_adam_step(emu, state, sumsq=sumsq)
    cpu_adam_step(want, sumsq=sumsq)
    assert_states_equal(state, want)

    state["grads"][-1][-1] = float("inf")
    before = clone_state(state)
    sumsq = emulated_grad_sumsq(emu, state["grads"])
    assert not torch.isfinite(sumsq)
    emulated_adam_step(emu, state, sumsq=sumsq)
    assert_states_equal(state, before)  # parameters, moments and step counts untouched


def test_a_tensor_of_more_chunks_than_one_launch_holds(emu):
    """321 chunks of 65536: the 320-block launch limit splits the tensor mid-way."""
    n = emu.emu_num_chunks(1) * 65536 * 320 + 3
    state = make_state([n, 9], torch.float32, torch.float32, False, seed=2)
    want = clone_state(state)
    emulated_adam_step(emu, state)
    cpu_adam_step(want)
    assert_states_equal(state, want)


# --------------------------------------------------------------------------- masking
class MaskParams(ctypes.Structure):
    """ctypes mirror of csrc/mask_math.h's MaskParams (checked against sizeof/offsetof)."""
    _fields_ = [("key0", ctypes.c_uint32), ("key1", ctypes.c_uint32), ("step", ctypes.c_uint32),
                ("strategy", ctypes.c_int32), ("select_threshold", ctypes.c_uint64),
                ("mask_threshold", ctypes.c_uint64), ("random_threshold", ctypes.c_uint64),
                ("vocab_size", ctypes.c_int64), ("mask_token_id", ctypes.c_int64),
                ("num_regular", ctypes.c_int64), ("num_special", ctypes.c_int32),
                ("special", ctypes.c_int64 * 64), ("span_cdf", ctypes.c_uint64 * 9)]


def emulated_mask_tokens(emu, ids, word_starts=None, sample_offset=0, return_spans=False, **kwargs):
    a = _arguments(ids, **{**dict(seed=0, step=0, vocab_size=50265, mask_token_id=None, pad_token_id=1,
                                  special_token_ids=(0, 1, 2, 3), mlm_probability=0.15, mask_replace_prob=0.8,
                                  random_replace_prob=0.1, strategy="token", word_starts=word_starts,
                                  sample_offset=sample_offset), **kwargs})
    rule = _Rule(a)  # the thresholds, as the NumPy twin of the C++ rule computes them
    special = sorted(set(a["special"]))
    p = MaskParams(key0=a["seed"] & 0xFFFFFFFF, key1=a["seed"] >> 32, step=a["step"], strategy=a["strategy"],
                   select_threshold=rule.select, mask_threshold=rule.to_mask, random_threshold=rule.to_random,
                   vocab_size=a["vocab_size"], mask_token_id=a["mask_token_id"],
                   num_regular=a["vocab_size"] - len(special), num_special=len(special))
    p.special[:len(special)] = special
    p.span_cdf[:] = rule.span_cdf
    ids64 = a["ids"].contiguous()
    out, labels = torch.empty_like(ids64), torch.empty_like(ids64)
    starts = None if a["word_starts"] is None else a["word_starts"].contiguous()
    spans = torch.empty(*ids64.shape, 3, dtype=torch.int64) if return_spans else None
    _check(emu.emu_mask_tokens(ctypes.byref(p), _ptr(ids64), _ptr(starts), ctypes.c_int64(ids64.shape[0]),
                               ctypes.c_int64(ids64.shape[1]), ctypes.c_uint32(a["sample_offset"]),
                               _ptr(out), _ptr(labels), _ptr(spans)))
    if return_spans:  # as rf.mask_tokens does after either device's kernel
        return out, labels, no_pad_boundaries(spans, ids64, a["pad_token_id"])
    return out, labels


def test_mask_params_mirror_has_the_c_layout(emu):
    assert ctypes.sizeof(MaskParams) == emu.emu_mask_params_size()
    assert MaskParams.special.offset == emu.emu_mask_params_special_offset()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("rows, length, probability, return_spans, word_rate", [
    (3, 7, 0.15, False, 0.6), (70, 300, 0.15, True, 0.6), (9, 40, 0.002, True, 0.6),
    (4, 300, 0.9, True, 0.6), (9, 200, 0.15, True, 0.02), (9, 200, 0.002, True, 0.0)])
def test_mask_tokens_matches_the_cpu_op(emu, strategy, rows, length, probability, return_spans,
                                        word_rate):
    """70 rows: two blocks of the serial kernel; 300 positions: more than a block's 256
    threads; probability 0.002: most rows rely on the at-least-one rule; 0.9: long spans,
    which the token kernel's threads scan across its 256-position stride; word_rate 0.02 /
    0: long words, which span budgets and the at-least-one rule cut mid-word."""
    gen = torch.Generator().manual_seed(rows * length)
    ids = torch.randint(4, 1000, (rows, length), generator=gen)
    ids[:, 0], ids[:, -1] = 0, 2
    ids[0, length // 2:] = 1  # padding
    if rows > 2:
        ids[2, :] = 1  # nothing maskable at all
    word_starts = torch.rand(rows, length, generator=gen) < word_rate
    kwargs = dict(seed=2**40 + 7, step=11, vocab_size=1000, mask_token_id=999, mlm_probability=probability,
                  strategy=strategy, word_starts=None if strategy == "token" else word_starts, sample_offset=5)
    got = emulated_mask_tokens(emu, ids, return_spans=return_spans, **kwargs)
    want = mask_tokens(ids, return_spans=return_spans, **kwargs)
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
    assert (want[1] != -100).sum() > 0


# --------------------------------------------------------------------- memory safety
@pytest.mark.skipif(os.environ.get(ASAN_SWITCH) == "1", reason="this is the run under AddressSanitizer itself")
def test_kernels_stay_in_bounds_under_address_sanitizer(tmp_path):
    """compute-sanitizer's memcheck, on the CPU: the tests above again, with the kernels built
    with AddressSanitizer and its runtime preloaded, so any read or write past a tensor (torch's
    CPU buffers get red zones too) or of freed memory stops the run with a report."""
    runtime = subprocess.run([shutil.which("g++") or "g++", "-print-file-name=libasan.so"],
                             capture_output=True, text=True).stdout.strip()
    assert os.path.isabs(runtime), "AddressSanitizer's runtime (gcc's libasan) is not installed"
    # libstdc++ preloaded after it: python does not link libstdc++, so without it ASan finds no __cxa_throw
    # to wrap and the first C++ exception thrown aborts (Triton 3.8's libtriton throws one while importing)
    cxx_runtime = subprocess.run([shutil.which("g++") or "g++", "-print-file-name=libstdc++.so"],
                                 capture_output=True, text=True).stdout.strip()
    if os.path.isabs(cxx_runtime):
        runtime = f"{runtime}:{cxx_runtime}"
    report = tmp_path / "asan"
    env = {**os.environ, ASAN_SWITCH: "1", "LD_PRELOAD": runtime,  # no leak check: the interpreter leaks
           "ASAN_OPTIONS": f"detect_leaks=0:abort_on_error=1:log_path={report}"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:faulthandler",
                          __file__, "-k", "not more_chunks"],  # the 84 MB tensor: slow under ASan, same code
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    reports = "".join(p.read_text() for p in tmp_path.glob("asan*"))
    assert not reports, reports[:6000]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
