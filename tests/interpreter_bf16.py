"""Make Triton's CPU interpreter compute the bf16 the kernels use as a GPU does (tests only).

Triton's interpreter (TRITON_INTERPRET=1) keeps bf16 values as raw uint16 bits, so
`tl.dot` on bf16 operands multiplies bit patterns as integers, and its fp32 -> bf16
cast truncates where the GPU rounds to nearest even (cvt.rn.bf16.f32, as torch's
`.to(torch.bfloat16)`). Those are the only bf16 operations the kernels perform (every
other step widens to fp32 first), so `install()` patches just those two:

- `tl.dot` widens bf16 operands to fp32 before multiplying: exact, as the tensor
  cores multiply bf16 exactly and accumulate in fp32;
- casts to bf16 (explicit, and the implicit one of a store) round to nearest even, and
  casts from bf16 widen it to fp32 first.

Other bf16 arithmetic (a bf16 + b bf16) stays wrong in the interpreter, so a kernel
that did some would fail its bf16 tests here rather than pass unnoticed.
tests/test_interpreter_bf16.py checks the patch against torch.
"""
import numpy as np
import pytest
import torch

ACTIVE = False  # True once install() has patched the interpreter
SKIP_REASON = ("needs a CUDA GPU: Triton's CPU interpreter computes bf16 tl.dot wrongly, and "
               "tests/interpreter_bf16.py could not patch this Triton version's interpreter")


def skip_unless_computed(device, dtype) -> None:
    """Skip a bf16 test on the CPU when the interpreter is not patched (it would compute garbage),
    and on a CUDA GPU without native bf16 (V100, T4: no Triton bf16 there; the product runs fp16)."""
    if dtype == torch.bfloat16 and device.type == "cpu" and not ACTIVE:
        pytest.skip(SKIP_REASON)
    if dtype == torch.bfloat16 and device.type == "cuda":
        from roberta_fast.precision import native_bf16

        if not native_bf16(device):
            major, minor = torch.cuda.get_device_capability(device)
            pytest.skip(f"bf16 needs a GPU with native bf16 (sm_80+); this one is sm_{major}{minor}")


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 values -> bf16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    odd = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + odd) >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def install() -> bool:
    """Patch the interpreter's builder once; False (nothing patched) if its internals differ."""
    global ACTIVE
    if ACTIVE:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
        builder, handle = interpreter.InterpreterBuilder, interpreter.TensorHandle
        dot, cast = builder.create_dot, builder.cast_impl
    except (ImportError, AttributeError):
        return False

    def widen(h):
        return handle(bf16_bits_to_fp32(h.data), tl.float32) if h.dtype.scalar == tl.bfloat16 else h

    def create_dot(self, a, b, *args, **kwargs):
        return dot(self, widen(a), widen(b), *args, **kwargs)

    def cast_impl(self, src, dst_type):  # every cast from or to bf16 goes through fp32
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar != tl.bfloat16:
            src = widen(src)
            if dst_type.scalar == tl.float32:
                return src
        elif dst_type.scalar == tl.bfloat16 and src.dtype.scalar != tl.bfloat16:
            return handle(fp32_to_bf16_bits(src.data.astype(np.float32)), dst_type.scalar)
        return cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl
    ACTIVE = True
    return True
