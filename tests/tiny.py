"""The tests' tiny models, each built one way everywhere. DeepSeek-V4: a config (tiny_reuse unless a test needs
another shape), the seeded random checkpoint state of `runtime.model.checkpoint.random_state` loaded into it, on the
CPU or, where a test asks for it, on CUDA with the Triton kernels (skipped where there is none). The Llama family:
a config (`TINY_LLAMA`: GQA, 9 heads over 3 KV heads, 8 layers, unless a test needs another), every weight drawn
from N(0, std) after `torch.manual_seed(seed)`."""
from __future__ import annotations

import pytest
import torch

from runtime.llama.config import LlamaConfig
from runtime.llama.model import Llama
from runtime.model.checkpoint import random_state
from runtime.model.config import ModelConfig, tiny_reuse
from runtime.model.deepseek_v4 import Transformer


def tiny_model(cfg: ModelConfig | None = None, seed: int = 1, device: str = "cpu") -> Transformer:
    cfg = cfg or tiny_reuse()
    if device == "cuda":
        import runtime.kernels as K
        if not (torch.cuda.is_available() and K.available()):
            pytest.skip("needs CUDA and Triton")
    with torch.device(device):
        m = Transformer(cfg)
    m.load_state_dict(random_state(cfg, seed=seed))
    return m.eval()


TINY_LLAMA = LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=500.0, bos_token_id=1,
                         eos_token_ids=(2,), model_type="llama")


def tiny_llama(cfg: LlamaConfig = TINY_LLAMA, seed: int = 0, std: float = 0.15) -> Llama:
    torch.manual_seed(seed)
    m = Llama(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=std)
    return m.eval()


def stored_tiny_llama(directory, cfg: LlamaConfig = TINY_LLAMA) -> Llama:
    """`tiny_llama(cfg)` saved as a checkpoint in `directory` and loaded back by the services' loader (by its
    config.json's model_type), as a worker or builder holds it."""
    from runtime.families import load_checkpoint
    from runtime.llama.loader import save_llama
    save_llama(tiny_llama(cfg), directory)
    return load_checkpoint(directory)


def random_request(seed: int, lengths: tuple[int, ...], question: int, vocab: int = 128) -> tuple[list, list]:
    """Documents of `lengths` random token ids (from 3: no special token) and a question of `question` ids."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    return docs, torch.randint(3, vocab, (question,), generator=g).tolist()
