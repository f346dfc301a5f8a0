"""Seeded random weights, and a checkpoint directory that names them instead of holding them.

A random-init checkpoint is `config.json`, `tokenizer.json` and `random-init.json` ({"format", "seed", "device"}),
with no weight files: every process that loads it (builder, worker, benchmark) draws the same weights, so a
Flash-shaped model at real dimensions serves through the whole stack without a 40 GB checkpoint on disk. The
spec file is part of the checkpoint identity (`services.common.serving.checkpoint_identity`), like a weight file.

Each parameter is drawn in float32 from a generator seeded by its name, on the spec's device type (CPU and CUDA
generators draw different numbers, so the device is part of what the spec names), and then rounded to the
model's dtype: the same weights a float32 checkpoint of those values would give when loaded in that dtype."""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from .checkpoint import copy_tokenizer
from .config import ModelConfig, to_official_json

RANDOM_INIT_FILE = "random-init.json"
FORMAT = "redknot.random-init.v1"


def init_random(model, seed: int, per_name: bool = True, device: torch.device | str | None = None) -> None:
    """Random weights scaled like a trained model's, in place. `per_name`: each parameter from its own generator
    seeded by its name, so that every process and TP rank draws the same replicated tensors; otherwise one
    generator in parameter order (bench/ttft.py's weights). The hash layers' routing comes from a CPU generator
    seeded by `seed` either way (it once drew from the global generator without `per_name`, so bench/ttft.py's
    model routed differently in every process).
    `device`: where the numbers are drawn (default: where the parameters live). Row-parallel W_b keeps the full
    fan-in's scale on every rank."""
    dev = torch.device(device) if device is not None else model.embed.weight.device
    shared = torch.Generator(device=dev).manual_seed(seed)
    cfg = model.cfg
    for name, p in model.named_parameters():
        gen = torch.Generator(device=dev).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode())) \
            if per_name else shared
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
            continue
        x = torch.empty(p.shape, dtype=torch.float32, device=dev) if p.dtype != torch.float32 or p.device != dev \
            else p.data
        if "hc_" in name and name.endswith("_fn"):
            x.normal_(0, 0.02, generator=gen)
        elif name == "embed.weight":
            x.normal_(0, 1.0, generator=gen)
        elif p.dim() == 2:
            fan_in = p.shape[1] * (model.par.size if ".wo_b." in name else 1)
            x.normal_(0, fan_in ** -0.5, generator=gen)
        else:
            x.normal_(0, 0.1, generator=gen)
        if x is not p.data:
            p.data.copy_(x)
    routing = torch.Generator().manual_seed(seed)     # never the global generator: every process the same table
    for block in model.layers:
        if block.ffn.gate.hash:
            tid = torch.stack([torch.randperm(cfg.n_routed_experts, generator=routing)[:cfg.n_activated_experts]
                               for _ in range(cfg.vocab_size)])
            block.ffn.gate.tid2eid.copy_(tid)


def read_spec(path: str | Path) -> dict | None:
    """The checkpoint's random-init spec, or None where it holds weights instead."""
    f = Path(path) / RANDOM_INIT_FILE
    if not f.is_file():
        return None
    spec = json.loads(f.read_text())
    if spec.get("format") != FORMAT or not isinstance(spec.get("seed"), int) or spec.get("device") not in ("cpu", "cuda"):
        raise ValueError(f"{f}: not a {FORMAT} spec (format, integer seed, device cpu|cuda): {spec}")
    return spec


def write_random_checkpoint(directory: str | Path, cfg: ModelConfig, seed: int, device: str,
                            tokenizer_json: str | Path) -> Path:
    """A random-init checkpoint directory for `cfg` (the official config.json) drawn on `device` ("cpu" or "cuda")."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(to_official_json(cfg), indent=1))
    copy_tokenizer(tokenizer_json, d)
    (d / RANDOM_INIT_FILE).write_text(json.dumps({"format": FORMAT, "seed": seed, "device": device}))
    return d
