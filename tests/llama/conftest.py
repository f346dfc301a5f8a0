import pytest


@pytest.fixture(autouse=True)
def _no_onednn_per_shape_jit():
    """oneDNN compiles a matmul kernel for every new shape (about 16 ms each on these CPUs); these tests run
    many small shapes once each, so they use MKL's sgemm instead (the same products up to float32 rounding)."""
    import torch
    with torch.backends.mkldnn.flags(enabled=False):
        yield
