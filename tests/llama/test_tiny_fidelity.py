"""Our Llama-family model against transformers on tiny random weights (no download), and the pieces the reuse
engine composes: qkv + attend + project equal the layer, LSE merges over split keys, head-sliced W_o, RoPE
relocation. Tolerance: max |ours - theirs| / max |theirs| <= 1e-4 (float32)."""
import pytest
import torch

from runtime.llama.config import LlamaConfig, LlamaConfigError
from runtime.llama.loader import CheckpointError, load_llama, save_llama
from runtime.llama.model import Llama, attend, merge

TOL = 1e-4
BASE = dict(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, rope_theta=500.0, bos_token_id=1, eos_token_ids=(2,))
CONFIGS = {
    "llama-gqa": dict(model_type="llama"),
    "qwen2-qkv-bias": dict(model_type="qwen2", qkv_bias=True),
    "llama-bias-llama3-rope": dict(model_type="llama", qkv_bias=True, o_bias=True, mlp_bias=True, rope_type="llama3",
                                   rope_factor=8.0, rope_original_max_position=64, max_position_embeddings=512),
    "llama-tied-linear-rope": dict(model_type="llama", rope_type="linear", rope_factor=2.0, tie_word_embeddings=True),
}


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def random_model(cfg: LlamaConfig, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    m = Llama(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.15)
    return m.eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    cfg = LlamaConfig(**BASE, **CONFIGS[request.param])
    path = tmp_path_factory.mktemp(request.param)
    save_llama(random_model(cfg), path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return cfg, load_llama(path), hf


def test_logits_equal_transformers(case):
    cfg, ours, hf = case
    tokens = torch.randint(0, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens[None], use_cache=False).logits[0]
    assert rel_err(ours(tokens, all_logits=True), ref) <= TOL
    if cfg.rope_type != "default":       # transformers read the same scaling, so the test above covers it
        assert hf.config.rope_parameters["rope_type"] == cfg.rope_type


def test_chunked_prefill_and_decode_equal_one_shot(case):
    cfg, ours, _ = case
    tokens = torch.randint(0, cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(2))
    full = ours(tokens, all_logits=True)
    cache = ours.new_cache()
    parts = [ours.prefill(tokens[:70], cache, chunk=17, all_logits=True)]
    parts += [ours(tokens[t:t + 1], cache, all_logits=True) for t in range(70, 90)]
    assert cache.pos == 90
    assert rel_err(torch.cat(parts), full) <= TOL


def test_generate_is_greedy_over_forward(case):
    cfg, ours, _ = case
    prompt = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    out, cache = ours.generate(prompt, 6, chunk=8, eos=())
    assert len(out) == 6 and cache.pos == 25
    seq = prompt.tolist()
    for t in out:
        assert t == int(ours(torch.tensor(seq)).argmax())
        seq.append(t)


def test_layer_pieces_compose(case):
    """The reuse engine's view of one attention layer: qkv, attend over key subsets merged by LSE, and W_o by
    head slices, reproduce the layer's own forward."""
    cfg, ours, _ = case
    attn = ours.layers[1].self_attn
    T = 40
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(T)
    with torch.inference_mode():
        ref = attn(x, pos, ours.new_cache().layers[1])
        q, k, v = attn.qkv(x, pos)
        o, lse = attn.attend(q, k, v, pos, pos)
        assert rel_err(attn.project(o), ref) <= TOL
        # keys split into two disjoint sets, each attended alone, merged: the same output and LSE
        cut = 23
        o1, l1 = attn.attend(q, k[:cut], v[:cut], pos, pos[:cut])
        o2, l2 = attn.attend(q, k[cut:], v[cut:], pos, pos[cut:])
        assert torch.isinf(l2[:cut]).all() and (o2[:cut] == 0).all()       # rows that see no key drop out
        om, lm = merge([(o1, l1), (o2, l2)])
        assert rel_err(om, o) <= TOL and rel_err(lm, lse) <= TOL
        # W_o by head slices (e.g. Global vs Local heads of a group) sums to the full projection less its bias
        H = cfg.num_attention_heads
        parts = attn.project(o[:, :2], slice(0, 2)) + attn.project(o[:, 2:], slice(2, H))
        bias = 0 if attn.o_proj.bias is None else attn.o_proj.bias
        assert rel_err(parts + bias, ref) <= TOL
        # roles per KV group: head 0 of each group Global, the rest Local (index list and bool mask)
        glob = torch.arange(H) % cfg.heads_per_kv == 0
        split = attn.project(o[:, glob], glob) + attn.project(o[:, ~glob], (~glob).nonzero().flatten().tolist())
        assert rel_err(split + bias, ref) <= TOL


def test_rope_relocation_is_a_rotation(case):
    """Keys roped at canonical positions 0..n-1 and queries rotated back by the offset Delta give the scores
    of keys roped at Delta..Delta+n-1: relocation needs no output de-rotation."""
    cfg, ours, _ = case
    attn, rot = ours.layers[0].self_attn, ours.rotary
    g = torch.Generator().manual_seed(5)
    x_doc, x_q = torch.randn(12, cfg.hidden_size, generator=g), torch.randn(3, cfg.hidden_size, generator=g)
    delta = 37
    with torch.inference_mode():
        _, k_canon, v = attn.qkv(x_doc, torch.arange(12))
        _, k_moved, _ = attn.qkv(x_doc, torch.arange(12) + delta)
        q, _, _ = attn.qkv(x_q, torch.tensor([60, 61, 62]))
        o_ref, lse_ref = attn.attend(q, k_moved, v)
        q_back = rot.rotate(q, torch.full((3,), -delta))
        o, lse = attn.attend(q_back, k_canon, v)
    assert rel_err(o, o_ref) <= TOL and rel_err(lse, lse_ref) <= TOL


def test_config_dialects_and_refusals():
    cfg = LlamaConfig(**BASE, model_type="qwen2", qkv_bias=True)
    assert LlamaConfig.from_hf(cfg.to_hf()) == cfg
    # transformers 5 writes rope_parameters instead of rope_theta / rope_scaling
    v5 = dict(LlamaConfig(**BASE).to_hf(), rope_scaling=None)
    v5.pop("rope_theta")
    v5["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    c5 = LlamaConfig.from_hf(v5)
    assert (c5.rope_theta, c5.rope_type, c5.rope_factor) == (5e5, "llama3", 8.0)
    with pytest.raises(LlamaConfigError, match="yarn"):
        LlamaConfig.from_hf(dict(cfg.to_hf(), rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(LlamaConfigError, match="num_key_value_heads"):
        LlamaConfig(**dict(BASE, num_key_value_heads=4))
    with pytest.raises(LlamaConfigError, match="model_type"):
        LlamaConfig.from_hf(dict(cfg.to_hf(), model_type="mistral"))


def test_loader_names_missing_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = LlamaConfig(**BASE)
    save_llama(random_model(cfg), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.1.mlp.up_proj.weight"):
        load_llama(tmp_path)


def test_attend_without_positions_sees_every_row():
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(4, 6, 8, generator=g), torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    o, lse = attend(q, k, v)
    # explicit per-head softmax, KV head h // 3
    kk, vv = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    s = torch.einsum("thd,shd->ths", q, kk) / 8 ** 0.5
    assert rel_err(o, torch.einsum("ths,shd->thd", s.softmax(-1), vv)) <= TOL
    assert rel_err(lse, s.logsumexp(-1)) <= TOL


def test_batched_greedy_decoding_equals_each_request_alone(case):
    """`greedy_many` (one batched step for several caches of equal length, no mask) against each request
    decoded alone with `forward`: the same tokens, and the same logits to 1e-4 along the way."""
    cfg, ours, _ = case
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, cfg.vocab_size, (40,), generator=g) for _ in range(3)]
    caches, firsts, want = [], [], []
    for p in prompts:
        c = ours.new_cache()
        firsts.append(ours.prefill(p, c))
        caches.append(c)
        alone = ours.new_cache()
        logits, ids = ours.prefill(p, alone), []
        for _ in range(6):
            ids.append(int(logits.argmax()))
            logits = ours(torch.tensor(ids[-1:]), alone)
        want.append(ids)
    assert ours.greedy_many(caches, firsts, 6, set()) == want
    stop = {want[1][2]}                                 # request 1 stops before its third token
    got = ours.greedy_many(caches, firsts, 6, stop)
    for ids, w in zip(got, want):
        cut = next((i for i, t in enumerate(w) if t in stop), len(w))
        assert ids == w[:cut]
    # one step's logits against the per-request forward
    kb, vb = ours.batched_cache(caches, 1)
    toks = torch.tensor([w[0] for w in want])
    with torch.inference_mode():
        batched = ours._decode_step(toks, kb, vb, caches[0].pos, ours.fused_weights())
    for b, c in enumerate(caches):
        assert rel_err(batched[b], ours(toks[b:b + 1], c)) <= TOL
