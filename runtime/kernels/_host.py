"""Host -> device copies that do not wait for the stream."""
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
