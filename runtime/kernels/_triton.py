"""The one guarded Triton import. Kernel modules define their @triton.jit functions only when HAVE_TRITON."""
from __future__ import annotations

import functools
import os

import torch

try:  # pragma: no cover - depends on the machine
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # ImportError, or a Triton that cannot initialise its backend
    triton, tl = None, None
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if HAVE_TRITON and INTERPRET:  # pragma: no cover - depends on the Triton and numpy versions
    try:
        from triton.runtime import interpreter as _interp

        _patch = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            """Triton 3.6's interpreter turns a scalar into a Python int with int(ndarray), which numpy >= 2.3
            refuses for a 1-element array of ndim 1; .item() reads the same value."""
            _patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
        _interp._patch_lang_tensor = _patch_lang_tensor

        import inspect
        _patched: dict[tuple[int, int], list] = {}

        def _patch_builtin(pkg, builder, scope):
            """The interpreter patches every builtin of triton.language on every launch: it finds them with
            inspect.getmembers and wraps each in a new semantic object, each time (a third of a CPU test's time
            went there). The builtins of a module are the same objects at every launch (each launch's patches are
            undone when it ends) and the builder is the interpreter's one, so the wrappers are made once per
            (module, builder) and only installed per launch."""
            wrapped = _patched.get((id(pkg), id(builder)))
            if wrapped is None:
                semantic = _interp.TritonSemantic(builder)
                wrapped = _patched[(id(pkg), id(builder))] = [
                    (name, lambda *args, member=member, **kwargs: member(
                        *args, **{k: v for k, v in kwargs.items() if k != "_semantic"}, _semantic=semantic))
                    for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
            for name, member in wrapped:
                scope.set_attr(pkg, name, member)
        _interp._patch_builtin = _patch_builtin
    except (ImportError, AttributeError):   # another Triton: its interpreter as it is
        pass

if HAVE_TRITON:
    @triton.jit
    def table_ptr(addr, dt: tl.constexpr):
        """An address read from a kernel's table (an int64, or a tensor of them) as a pointer to `dt`, told 16-byte
        aligned (`_host.ALIGN`: the tables point only at `_host.aligned` tensors). Triton knows the alignment of a
        pointer argument, not of a loaded address: untold, a key tile is read two bytes at a time with no
        asynchronous copy (tests/kernels/compile_sm90.py fails a table reader without 16-byte reads)."""
        return tl.multiple_of(addr.to(tl.pointer_type(dt)), 16)

    @triton.jit
    def online_step(s, svalid, m_i, l_i, dt: tl.constexpr):
        """One key tile's scores s [M, N] (log2 domain) into an online softmax, the step every attention kernel
        takes: masked to svalid, the running max and denominator moved on; returns them with the tile's weights (in
        dt, for the value dots) and the factor alpha the earlier sums are rescaled by (0 while the max is -inf)."""
        s = tl.where(svalid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])                                   # 0 at masked keys
        return m_new, l_i * alpha + tl.sum(p, 1), p.to(dt), alpha


@functools.cache
def available() -> bool:
    """True when the Triton kernels can run here: Triton imports and a CUDA device is present. Asked once per
    process: every kernel call asks it (`runtime.kernels.enabled`), and torch.cuda.is_available() queries NVML each
    time, about 2600 queries of host time in one 16K reuse prefill."""
    return HAVE_TRITON and torch.cuda.is_available()


def check_runnable(t: torch.Tensor) -> None:
    """Kernels run on CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1, for debugging)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not importable here; use the reference path (runtime.kernels.reference)")
    if not (t.is_cuda or INTERPRET):
        raise RuntimeError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for a CPU debug run)")


def dot_precision(dtype: torch.dtype) -> str:
    """Input precision of the kernels' tl.dot: float32 operands are multiplied in full float32 ("ieee"), so that
    the float32 path equals the float32 reference to rounding (Triton's default for float32 is TF32, a 10-bit
    mantissa); for bf16/fp16 operands "tf32" is Triton's own default and changes nothing."""
    return "ieee" if dtype == torch.float32 else "tf32"


def enabled(t: torch.Tensor) -> bool:
    """The one switch between the fast path and the reference path: Triton kernels for CUDA tensors unless
    REDKNOT_KERNELS=0 (then, and on CPU, the torch reference path runs). Here, beside the guarded import, so that
    the kernel modules read it without importing their package (`runtime.kernels` re-exports it); callers read it
    at call time (`_triton.enabled(x)`, `K.enabled(x)`), which is where the CPU tests patch it."""
    return t.is_cuda and available() and os.environ.get("REDKNOT_KERNELS", "1") != "0"
