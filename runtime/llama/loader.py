"""Build a Llama-family model from a transformers-layout checkpoint directory (config.json and one or more
*.safetensors files, sharded or not)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import LlamaConfig
from .model import Llama


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match its config (missing, unexpected or misshapen). Nothing is
    loaded; the message names the tensors."""


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in the directory, under transformers' names."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def to_model_names(cfg: LlamaConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' names -> ours (drop the `model.` prefix; a tied head is the embedding, not a tensor)."""
    out = {}
    for name, t in state.items():
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        out[name] = t
    return out


def load_llama(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               q_chunk: int = 1024) -> Llama:
    cfg = LlamaConfig.from_file(path)
    state = to_model_names(cfg, read_state(path))
    with torch.device("meta"):
        model = Llama(cfg, dtype, q_chunk)
    want = {k: v.shape for k, v in model.state_dict().items()}
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    misshapen = sorted(k for k in set(want) & set(state) if tuple(state[k].shape) != tuple(want[k]))
    if missing or unexpected or misshapen:
        raise CheckpointError(f"{path}: missing {missing[:8]}, unexpected {unexpected[:8]}, "
                              f"misshapen {[(k, tuple(state[k].shape), tuple(want[k])) for k in misshapen[:8]]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.to(device).eval()


def save_llama(model: Llama, path: str | Path) -> None:
    """Write config.json and model.safetensors under transformers' names (a small random model for tests,
    or a converted one)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=2) + "\n")
    state = {f"model.{k}" if not k.startswith("lm_head.") else k: v.detach().contiguous().cpu()
             for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
