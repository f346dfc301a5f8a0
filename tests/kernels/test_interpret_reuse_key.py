"""test_interpret.py's reuse prefill and decode cases 4-6 through the kernels under Triton's interpreter (the same
test, `reuse_case`; a file of its own so that the cases run on several test processes)."""
import pytest
import torch

from .test_interpret import TOL, REUSE_CASES, kernels_on, model, pytestmark, request_tokens, reuse_case  # noqa: F401


@torch.no_grad()
@pytest.mark.parametrize("fused,picks,frame", REUSE_CASES[4:])
def test_reuse_prefill_and_decode_through_the_kernels(model, request_tokens, kernels_on, monkeypatch, fused, picks,  # noqa: F811
                                                      frame):
    errs = reuse_case(model, request_tokens, kernels_on, monkeypatch, fused, picks, frame)
    assert max(errs) <= TOL, errs
