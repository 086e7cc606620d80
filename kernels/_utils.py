"""Small helpers the Triton kernels share: input checks, device context, launch shapes."""
import contextlib
import functools
import os

import torch
import triton

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
        f"{op}: the Triton kernel runs on CUDA tensors (or on CPU tensors when "
        f"TRITON_INTERPRET=1 is set before triton is imported), got a {device.type} tensor; "
        f"move the inputs to a GPU or call {op}_ref instead"
    )


def on_device(device: torch.device):
    """Context making `device` current, so Triton launches on the tensors' GPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_programs(device: torch.device) -> int:
    """How many persistent programs a reduction over rows is split into."""
    if device.type == "cuda":
        return 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # the interpreter runs programs one after another


def tile_shape(n_cols: int, n_rows: int, device: torch.device, max_cols: int):
    """(BLOCK_M, BLOCK_N, num_warps) for row tiles of up to `max_cols` columns.

    On the GPU a tile holds ~4K elements (16 per thread); under the interpreter
    tiles are bigger because each program costs Python overhead.
    """
    block_n = min(triton.next_power_of_2(n_cols), max_cols)
    target = 4096 if device.type == "cuda" else 16384
    block_m = max(1, min(target // block_n, triton.next_power_of_2(max(n_rows, 1))))
    num_warps = max(1, min(16, block_m * block_n // 512))
    return block_m, block_n, num_warps
