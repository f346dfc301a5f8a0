import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Without a GPU the Triton kernels run under Triton's interpreter (tests/kernels/test_interpret.py): the switch must
# be set before any kernel module is imported, since @triton.jit picks the interpreter at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from triton.runtime import interpreter as _interp

        _patch = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            """Triton 3.6's interpreter turns a scalar into a Python int with int(ndarray), which numpy >= 2.3
            refuses for a 1-element array of ndim 1; .item() reads the same value."""
            _patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
        _interp._patch_lang_tensor = _patch_lang_tensor
    except ImportError:          # no Triton: tests/kernels/test_interpret.py is skipped
        pass
