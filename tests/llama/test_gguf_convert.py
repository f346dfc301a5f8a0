"""The converter on GGUF files written here as llama.cpp writes them: a tiny random Llama (GQA, q/k rows
permuted, Q8_0) and a tiny random Qwen2 (q/k/v biases, not permuted, tied head) convert to checkpoints whose
weights are the file's weights and whose logits equal a model holding them; each supported pre-tokenizer
agrees with llama.cpp's tokenizer; unsupported files are refused."""
import json

import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from runtime.llama.config import LlamaConfig
from runtime.llama.gguf import PRE_TOKENIZERS, ConvertError, convert_gguf, gguf_tokenizer
from runtime.llama.loader import load_llama
from runtime.llama.model import Llama
from runtime.llama.tokenizer import ChatTokenizer
from tests.llama.tiny_gguf import write_model_gguf, write_vocab_gguf

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())
TINY_VOCAB = dict(tokens=ALPHABET + ["he", "hel", "<|im_start|>", "<|im_end|>"],
                  types=[1] * 258 + [3, 3], merges=["h e", "he l"], pre="gpt-2", bos=258, eos=259, template=TEMPLATE)
BASE = dict(vocab_size=260, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, rope_theta=1000.0, rms_norm_eps=1e-5, max_position_embeddings=512,
            bos_token_id=258, eos_token_ids=(259,))
TEXTS = ["Digits 1234567890 and 3.14159, dates 2024-05-06.", "Mixed\nnew\n\nlines\tand\t\ttabs\r\n  x",
         "don't CAN'T I'LL we've they're", "Ünïcödé — em dash, “quotes”, 日本語, emoji 🙂.",
         "  leading   spaces\n\n\n  code:  x = [1,2,3];;\n", "<|im_start|>user\nhi<|im_end|>\n"]


def random_model(cfg: LlamaConfig) -> Llama:
    torch.manual_seed(0)
    m = Llama(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.15)
    return m.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_gguf_converts_to_the_files_weights(kind, tmp_path):
    extra = dict(model_type="llama") if kind == "llama" else dict(model_type="qwen2", qkv_bias=True,
                                                                   tie_word_embeddings=True)
    cfg = LlamaConfig(**BASE, **extra)
    model = random_model(cfg)
    held = write_model_gguf(tmp_path / "tiny.gguf", model, TINY_VOCAB)
    r = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "ckpt")
    assert r.config == cfg and not r.cached
    assert r.quant_types == {"Q8_0": 7 * 2 + 1 + (0 if cfg.tie_word_embeddings else 1),
                             "F32": 2 * 2 + 1 + (3 * 2 if cfg.qkv_bias else 0)}
    ours = load_llama(r.out)
    for name, t in ours.state_dict().items():
        assert np.array_equal(t.numpy(), held[name]), name          # q/k rows back in rotate-half order
    ref = Llama(cfg)
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in held.items()})
    tokens = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(ours(tokens, all_logits=True), ref.eval()(tokens, all_logits=True))
    tok = ChatTokenizer.from_dir(r.out)
    assert tok.encode("hello") == [259 - 2, ALPHABET.index("l"), ALPHABET.index("o")]     # "hel" merged
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"
    assert convert_gguf(tmp_path / "tiny.gguf", tmp_path / "ckpt").cached


class DictMeta(dict):
    """GGUF metadata from a dict (what gguf_tokenizer reads), so no GGUF file needs parsing."""

    def need(self, key):
        return self[key]


def test_pre_tokenizers_agree_with_llama_cpp(smollm2_dir, tmp_path):
    """Each supported pre-tokenizer, rebuilt on SmolLM2's vocabulary, against llama.cpp's own."""
    llama_cpp = pytest.importorskip("llama_cpp")
    spec = json.loads((smollm2_dir / "tokenizer.json").read_text())
    tokens = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    vocab = dict(tokens=tokens, types=[3 if i in special else 1 for i in range(len(tokens))],
                 merges=[" ".join(m) for m in spec["model"]["merges"]], bos=1, eos=2, template=None)
    cfg = LlamaConfig(**dict(BASE, vocab_size=len(tokens)))
    for pre in PRE_TOKENIZERS:
        write_vocab_gguf(tmp_path / f"{pre}.gguf", cfg, dict(vocab, pre=pre))
        ref = llama_cpp.Llama(str(tmp_path / f"{pre}.gguf"), vocab_only=True, verbose=False)
        ours = gguf_tokenizer(DictMeta({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                                        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": vocab["types"],
                                        "tokenizer.ggml.merges": vocab["merges"]}))
        for text in TEXTS:
            assert ours.encode(text).ids == ref.tokenize(text.encode(), add_bos=False, special=True), (pre, text)


def test_refusals(tmp_path):
    cfg = LlamaConfig(**BASE)
    cases = [(cfg, dict(TINY_VOCAB, pre="no-such-pre"), "no-such-pre"),
             (cfg, dict(TINY_VOCAB), "missing"),                          # no tensors
             (LlamaConfig(**dict(BASE, model_type="qwen2", qkv_bias=True)), dict(TINY_VOCAB), "Qwen2 has q/k/v biases")]
    for i, (c, vocab, message) in enumerate(cases):
        write_vocab_gguf(tmp_path / f"{i}.gguf", c, vocab)
        with pytest.raises(ConvertError, match=message):
            convert_gguf(tmp_path / f"{i}.gguf", tmp_path / "out")
        assert not (tmp_path / "out").exists()
