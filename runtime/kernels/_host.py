"""Host -> device copies that do not wait for the stream; tensors whose addresses go into a kernel's table."""
from __future__ import annotations

import torch


def to_device_nowait(t: torch.Tensor, device) -> torch.Tensor:
    """`t` (a host tensor: index lists, pointer tables) on `device` without waiting for the stream: to CUDA
    through page-locked memory with a non-blocking copy (a blocking copy from pageable memory synchronizes the
    stream). The pinned source is torch's, so its block is not reused before the copy has run. Anything else
    (another device, a tensor already off the host) is a plain `.to`."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


ALIGN = 16      # bytes: what a kernel reading an address from a table is told (tl.multiple_of) of that address


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous at an address that is a multiple of ALIGN bytes (a copy where it is not: a view starting
    mid-row of a narrow tensor), for kernels that read the address from a table. Triton specialises a pointer
    argument on its alignment, but knows nothing of one loaded from memory: without the hint a key tile is read
    two bytes at a time, with no asynchronous copy (the stacked parts ran at half the speed of a launch per part)."""
    t = t.contiguous()
    return t if t.data_ptr() % ALIGN == 0 else t.clone()
