"""`runtime.reuse.store._safetensors_views`: the artifact reader's zero-copy parse of a safetensors file. It must
give exactly what `safetensors.torch.load` gives (every dtype an artifact uses, an offset not aligned to its element
size included), make views of the bytes (no copy), and never accept a file the library refuses: mutated headers raise
ValueError or RuntimeError only, and where the views parse, the library parses the same tensors."""
import json
import random

import pytest
import safetensors.torch
import torch

from runtime.reuse.store import _safetensors_views

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.int32, torch.uint8, torch.float8_e4m3fn]


def _random(dtype: torch.dtype, shape, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point and dtype.itemsize > 1:
        return torch.randn(*shape, generator=g).to(dtype)
    return torch.randint(0, 255, shape, generator=g, dtype=torch.uint8).view(torch.uint8).to(torch.int64).to(
        dtype if dtype != torch.float8_e4m3fn else torch.uint8).view(dtype)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


def _file(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    ts = {f"t{i}": _random(dt, (int(torch.randint(0, 5, (1,), generator=g)), 3), g) for i, dt in enumerate(DTYPES)}
    return safetensors.torch.save(ts)


@pytest.mark.parametrize("seed", range(4))
def test_views_equal_the_library_and_share_the_bytes(seed):
    raw = bytearray(_file(seed))
    want, got = safetensors.torch.load(bytes(raw)), _safetensors_views(raw)
    assert _same(want, got)
    # views, not copies: a write into the bytes shows in every non-empty tensor
    base = torch.frombuffer(raw, dtype=torch.uint8)
    for k, t in got.items():
        if t.numel():
            assert base.data_ptr() <= t.data_ptr() < base.data_ptr() + len(raw), k


def test_a_misaligned_tensor_is_copied_and_still_equal():
    """A header that puts an fp32 tensor at an odd offset (valid safetensors; our writer never does)."""
    a, b = torch.arange(3, dtype=torch.uint8), torch.randn(5)
    data = a.numpy().tobytes() + b.numpy().tobytes()
    header = json.dumps({"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "b": {"dtype": "F32", "shape": [5], "data_offsets": [3, 23]}}).encode()
    header += b" " * (-len(header) % 8)
    raw = len(header).to_bytes(8, "little") + header + data
    got = _safetensors_views(raw)
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    assert _same(got, safetensors.torch.load(raw))


def test_mutated_headers_are_refused_or_agree_with_the_library():
    rng = random.Random(0)
    raw = _file(7)
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    refused = 0
    for trial in range(400):
        h = json.loads(json.dumps(header))
        k = rng.choice(sorted(h))
        what = rng.randrange(7)
        if what == 0:
            h[k]["data_offsets"][rng.randrange(2)] += rng.choice([-3, -1, 1, 2, 64])
        elif what == 1:
            h[k]["shape"][rng.randrange(2)] += rng.choice([-1, 1, 5])
        elif what == 2:
            h[k]["dtype"] = rng.choice(["F32", "BF16", "I64", "U8", "X9", 3])
        elif what == 3:
            h[k]["shape"] = rng.choice([None, "3", [1.5, 3], [-1, 3], []])
        elif what == 4:
            h[k]["data_offsets"] = rng.choice([None, [0], [0, 1, 2], ["0", 3]])
        elif what == 5:
            del h[k]
        else:
            h = rng.choice([[], "x", 3, None])
        body = json.dumps(h).encode()
        body += b" " * (-len(body) % 8)
        cut = rng.choice([0, 0, 0, 1, 7])
        blob = len(body).to_bytes(8, "little") + body + raw[8 + n:len(raw) - cut]
        try:
            got = _safetensors_views(blob)
        except (ValueError, RuntimeError):
            refused += 1
            continue
        assert _same(got, safetensors.torch.load(blob)), (trial, h)
    assert refused > 300          # the mutations above are nearly all invalid
    with pytest.raises(ValueError):
        _safetensors_views(b"\x01\x00")
    with pytest.raises(ValueError):
        _safetensors_views((10**6).to_bytes(8, "little") + b"{}")
