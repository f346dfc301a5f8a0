"""On a CUDA device (skipped elsewhere): the same logits as on the CPU in float32, bf16 close to float32,
chunked prefill + decode equal one shot, greedy generation runs. A tiny random model; no download."""
import pytest
import torch

from runtime.llama.config import LlamaConfig
from runtime.llama.model import Llama
from tests.tiny import tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CFG = LlamaConfig(model_type="qwen2", qkv_bias=True, vocab_size=256, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, rope_theta=1e4)


def rel_err(a, b) -> float:
    return ((a.float().cpu() - b.float().cpu()).abs().max() / b.float().cpu().abs().max()).item()


@pytest.fixture(scope="module")
def models():
    cpu = tiny_llama(CFG, std=0.1)
    gpu = Llama(CFG).cuda()
    gpu.load_state_dict(cpu.state_dict())
    bf16 = Llama(CFG, dtype=torch.bfloat16).cuda()
    bf16.load_state_dict({k: v.bfloat16() for k, v in cpu.state_dict().items()})
    return cpu, gpu.eval(), bf16.eval()


def test_cuda_float32_equals_cpu(models):
    cpu, gpu, _ = models
    tokens = torch.randint(0, CFG.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    assert rel_err(gpu(tokens.cuda(), all_logits=True), cpu(tokens, all_logits=True)) <= 1e-4


def test_bf16_close_to_float32_and_chunking_exact_enough(models):
    cpu, _, bf16 = models
    tokens = torch.randint(0, CFG.vocab_size, (300,), generator=torch.Generator().manual_seed(2))
    ref = cpu(tokens, all_logits=True)
    full = bf16(tokens.cuda(), all_logits=True)
    assert full.dtype == torch.float32 and rel_err(full, ref) <= 5e-2
    cache = bf16.new_cache()
    parts = [bf16.prefill(tokens[:280].cuda(), cache, chunk=64, all_logits=True)]
    parts += [bf16(tokens[t:t + 1].cuda(), cache, all_logits=True) for t in range(280, 300)]
    assert rel_err(torch.cat(parts), full) <= 5e-2


def test_generate_on_cuda(models):
    _, gpu, bf16 = models
    prompt = torch.randint(0, CFG.vocab_size, (50,), generator=torch.Generator().manual_seed(3)).cuda()
    out, cache = gpu.generate(prompt, 8, chunk=16, eos=())
    assert len(out) == 8 and cache.pos == 57
    assert len(bf16.generate(prompt, 8, eos=())[0]) == 8
