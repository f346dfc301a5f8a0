"""One SmolLM2-135M-Instruct conversion per test session (about 4 s), into a temporary directory."""
import pytest

from runtime.llama.gguf import convert_gguf


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    return convert_gguf(out_dir=tmp_path_factory.mktemp("smollm2") / "ckpt").out


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    from runtime.llama.loader import load_llama
    return load_llama(smollm2_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(autouse=True)
def _no_onednn_per_shape_jit():
    """oneDNN compiles a matmul kernel for every new shape (about 16 ms each on these CPUs); these tests run
    many small shapes once each, so they use MKL's sgemm instead (the same products up to float32 rounding)."""
    import torch
    with torch.backends.mkldnn.flags(enabled=False):
        yield
