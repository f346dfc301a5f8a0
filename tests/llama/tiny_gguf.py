"""Write GGUF files the way llama.cpp's converter does (names, q/k row permutation for Llama, metadata), for
converter tests that need no download: a tiny random model, or a vocab-only file with another pre-tokenizer."""
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from runtime.llama.model import Llama

GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (rotate-half halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_vocab(w: GGUFWriter, tokens, types, merges, pre: str, bos: int, eos: int, template: str | None):
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    if template:
        w.add_chat_template(template)


def add_hparams(w: GGUFWriter, cfg):
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)


def write_model_gguf(path, model: Llama, vocab: dict, qtype=GGMLQuantizationType.Q8_0) -> dict[str, np.ndarray]:
    """Write `model` as llama.cpp would (2-D weights quantized to `qtype`, norms and biases in F32). Returns
    the weights the file really holds, dequantized, under our names (what a correct converter must load)."""
    cfg = model.cfg
    w = GGUFWriter(str(path), cfg.model_type)
    add_hparams(w, cfg)
    add_vocab(w, **vocab)
    held = {}
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if name == "embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, i, rest = name.split(".", 2)
            gname = f"blk.{i}.{GGUF_NAMES[rest]}"
        if a.ndim == 2:
            q = quantize(a, qtype)
            a = dequantize(q, qtype).reshape(a.shape)
        held[name] = a.copy()
        if cfg.model_type == "llama" and gname.split(".")[-2] in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads
            a = llama_cpp_permute(a, heads)
        if a.ndim == 2:
            w.add_tensor(gname, quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def write_vocab_gguf(path, cfg, vocab: dict):
    """A vocab-only file (hyper-parameters and tokenizer, no tensors): enough for llama.cpp's vocab_only."""
    w = GGUFWriter(str(path), cfg.model_type)
    add_hparams(w, cfg)
    add_vocab(w, **vocab)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
