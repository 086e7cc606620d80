"""Small helpers the Triton kernels share: input checks, device context, launch shapes."""
import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# Triton picks its interpreter when a kernel is decorated, i.e. when the kernel files import
# (this module first): read the variable once, here, as they do. Set later, it changes nothing.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True when the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 when imported)."""
    return INTERPRET


def _fix_interpreter_scalar_index() -> None:
    """Let Triton <= 3.6's interpreter run these kernels with NumPy >= 2.4.

    That interpreter turns a scalar (a kernel's `range()` bound) into an int with int()
    of a 1-element array, which NumPy 2.4 refuses (a DeprecationWarning before); Triton
    3.7+ squeezes the array first. This does the same for older versions, and nothing
    where the interpreter's internals differ.
    """
    try:
        from triton.runtime import interpreter

        patch_tensor = interpreter._patch_lang_tensor
    except (ImportError, AttributeError):
        return
    if getattr(patch_tensor, "squeezes_scalars", False):
        return

    def scalar_index(self):
        return int(self.handle.data.squeeze())

    def patched(tensor, *scope):  # Triton 3.0-3.1: (tensor); 3.2+: (tensor, scope)
        patch_tensor(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", scalar_index)
        else:
            tensor.__index__ = scalar_index

    patched.squeezes_scalars = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    _fix_interpreter_scalar_index()


def check_tensor(t, name: str, device: torch.device, op: str) -> None:
    """Raise TypeError/ValueError unless `t` is a float tensor on `device`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{op}: {name} has dtype {t.dtype}; supported dtypes are float32, float16 "
            f"and bfloat16 (convert it with .float() or .half())"
        )
    if t.device != device:
        raise ValueError(
            f"{op}: {name} is on {t.device} but x is on {device}; move all inputs to one device"
        )


def check_triton_device(device: torch.device, op: str) -> None:
    """Raise ValueError unless Triton can run on `device` in this process."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreting():
        return
    raise ValueError(
        f"{op}: the Triton kernel runs on CUDA tensors (or on CPU tensors under Triton's interpreter: "
        f"set TRITON_INTERPRET=1 before importing triton or roberta_fast.kernels), got a {device.type} "
        f"tensor; move the inputs to a GPU or call {op}_ref instead"
    )


def on_device(device: torch.device):
    """Context making `device` current, so Triton launches on the tensors' GPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Passed to every launch. Fused multiply-adds are what Triton up to 3.9 does unasked, and 3.9
# warns that 3.10 will not: asked for, the kernels compile to the same code under every Triton
# (what the compile report measures is what runs), and a GPU run prints no warning.
LAUNCH_OPTIONS = {"enable_fp_fusion": True}


def num_programs(device: torch.device) -> int:
    """How many persistent programs a reduction over rows is split into."""
    if device.type == "cuda":
        return 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # the interpreter runs programs one after another


def tile_shape(n_cols: int, n_rows: int, device: torch.device, max_cols: int, min_cols: int = 1,
               per_thread: int = 16):
    """(BLOCK_M, BLOCK_N, num_warps) for row tiles of min_cols up to `max_cols` columns.

    On the GPU a tile holds ~256 * per_thread elements, per_thread of them per thread (8 warps;
    wider rows take up to 16 warps, then more per thread); under the interpreter tiles are bigger
    because each program costs Python overhead. min_cols: a kernel calling philox_rand16 needs
    BLOCK_N >= 8 (it masks the columns past n_cols).
    """
    block_n = max(min(triton.next_power_of_2(n_cols), max_cols), min_cols)
    target = 256 * per_thread if device.type == "cuda" else 16384
    block_m = max(1, min(target // block_n, triton.next_power_of_2(max(n_rows, 1))))
    num_warps = max(1, min(16, block_m * block_n // (32 * per_thread)))
    return block_m, block_n, num_warps


@triton.jit
def philox_rand16(seed, rows, start_col, c2, c3, BLOCK_N: tl.constexpr):
    """16-bit Philox randoms, int32 in [0, 65536), for `rows` x columns start_col..start_col+BLOCK_N.

    One Philox-4x32-10 call (key: the 64-bit seed; counter: row, column // 8, c2, c3)
    serves 8 columns, two 16-bit halves of each of its 4 words: column 8g + i gets the
    low half of word i, column 8g + 4 + i its high half (start_col must be a multiple
    of 8). A quarter of the Philox work of one call per column, a random depending
    only on (seed, row, column, c2, c3), never on block sizes. Dropout keeps an
    element where rand >= round(p * 65536), a drop rate within 8e-6 of p.
    """
    groups = start_col // 8 + tl.arange(0, BLOCK_N // 8)
    zero = tl.zeros([rows.shape[0], BLOCK_N // 8], dtype=tl.int32)
    r0, r1, r2, r3 = tl.philox(seed, zero + rows[:, None], zero + groups[None, :], zero + c2, zero + c3)
    lo0, lo1, lo2, lo3 = r0 & 0xFFFF, r1 & 0xFFFF, r2 & 0xFFFF, r3 & 0xFFFF
    hi0, hi1, hi2, hi3 = r0 >> 16, r1 >> 16, r2 >> 16, r3 >> 16
    # 8 x (rows, BLOCK_N // 8) -> (rows, BLOCK_N): each level doubles the column stride it fills
    r = tl.interleave(tl.interleave(tl.interleave(lo0, hi0), tl.interleave(lo2, hi2)),
                      tl.interleave(tl.interleave(lo1, hi1), tl.interleave(lo3, hi3)))
    return r.to(tl.int32)


def dropout_threshold(dropout_p: float) -> int:
    """The 16-bit keep threshold of philox_rand16 for drop probability p (p = 1 drops all)."""
    return min(int(round(dropout_p * 65536)), 65536)
