import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Without a GPU the Triton kernels run under Triton's interpreter (tests/kernels/test_interpret.py): the switch must
# be set before any kernel module is imported, since @triton.jit picks the interpreter at decoration time
# (runtime/kernels/_triton.py then fits the interpreter to numpy >= 2.3).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
