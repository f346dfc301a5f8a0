"""The tokenizer rebuilt from GGUF metadata and our chat-template rendering agree with transformers'
AutoTokenizer on the converted directory and with llama.cpp's own tokenizer on the GGUF."""
import pytest

from runtime.llama.gguf import smollm2_gguf_path
from runtime.llama.tokenizer import ChatTokenizer

TEXTS = [
    "Hello world!",
    "  leading spaces, trailing spaces   ",
    "Digits 1234567890 and 3.14159, dates 2024-05-06.",
    "Mixed\nnew\n\nlines\tand\t\ttabs\r\n",
    "Ünïcödé — em dash, “quotes”, 日本語, emoji 🙂.",
    "don't can't I'll we've they're",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
    "def f(x):\n    return x ** 2  # code",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Who wrote Hamlet?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Documents:\n1. A\n2. B\n\nQuestion: which?"}],
]


@pytest.fixture(scope="module")
def ours(smollm2_dir):
    return ChatTokenizer.from_dir(smollm2_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_agree_with_transformers(ours, hf_tokenizer, text):
    ids = ours.encode(text)
    assert ids == hf_tokenizer(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == text == hf_tokenizer.decode(ids)
    assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_encode_agrees_with_llama_cpp(ours):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(smollm2_gguf_path()), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert ours.encode(text) == llm.tokenize(text.encode(), add_bos=False, special=True), text


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_agrees_with_transformers(ours, hf_tokenizer, messages, gen):
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.render_chat(messages, add_generation_prompt=gen) == text
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ours.encode_chat(messages, add_generation_prompt=gen) == list(ids)


def test_special_tokens(ours, hf_tokenizer):
    assert ours.special["eos_token"] == hf_tokenizer.eos_token == "<|im_end|>"
    assert ours.token_id("<|im_end|>") == 2 and ours.token_id("<|im_start|>") == 1
    assert ours.render_chat(CHATS[0]).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
