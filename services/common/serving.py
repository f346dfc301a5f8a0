"""What a document's artifacts are bound to, computed the same way by the API, the builder and the workers:
the checkpoint identity, the reuse profile, the document id and the store key."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import blake3
import torch

from runtime.families import check_profile, checkpoint_family, family, load_checkpoint
from runtime.llama.config import LlamaConfig
from runtime.model.config import ModelConfig, load_config
from runtime.model.random_init import RANDOM_INIT_FILE
from runtime.reuse.certificate import digest_bytes, token_hash
from runtime.reuse.producer import pad_document
from runtime.reuse.profile import ReuseProfile
from runtime.reuse.request import ServingIdentity
from services.store.keys import DocumentKey, content_hash, profile_id

def serving_dtype(setting: str, device: str) -> torch.dtype:
    """The model's (and its artifacts') dtype from the `dtype` setting: auto is bfloat16 on CUDA (what the GPU
    kernels run), float32 on CPU."""
    if setting == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[setting]


def load_serving_model(path: str | Path, group, dtype_setting: str, policy, profile: ReuseProfile):
    """This rank's model of either family (`runtime.families`) in the serving dtype on its device, the runtime
    policy set (DeepSeek-V4's kernels and chunking) and `profile` checked against it; the Llama family at TP1."""
    model = load_checkpoint(path, dtype=serving_dtype(dtype_setting, group.device), device=group.device,
                            par=group.par)
    if family(model) == "deepseek_v4":
        model.set_policy(policy)
    check_profile(profile, model)
    return model


def tokenizer_fingerprint(path: str | Path) -> str:
    return digest_bytes((Path(path) / "tokenizer.json").read_bytes())


def checkpoint_identity(path: str | Path, fingerprint: str = "") -> ServingIdentity:
    """Tokenizer fingerprint: blake3 of tokenizer.json. Checkpoint fingerprint (unless given): blake3 over
    config.json, every weight file's name and bytes in name order (the safetensors files, or a random-init
    checkpoint's spec), and the tokenizer fingerprint, so any changed weight, config or tokenizer makes every
    artifact built before it stale."""
    path = Path(path)
    tok_fp = tokenizer_fingerprint(path)
    if fingerprint:
        return ServingIdentity(fingerprint, tok_fp)
    h = blake3.blake3(b"redknot.checkpoint-files.v1\0", max_threads=blake3.blake3.AUTO)
    h.update((path / "config.json").read_bytes())
    for f in sorted([*path.glob("*.safetensors"), *path.glob(RANDOM_INIT_FILE)]):
        h.update(f"\0{f.name}\0{f.stat().st_size}\0".encode())
        h.update_mmap(f)
    h.update(tok_fp.encode())
    return ServingIdentity(h.hexdigest(), tok_fp)


def model_config(path: str | Path) -> ModelConfig | LlamaConfig:
    """The checkpoint's config, of either family."""
    if checkpoint_family(path) == "llama":
        return LlamaConfig.from_file(path)
    return load_config(path)


def document_id(tokens: list[int], tokenizer_fingerprint: str, tenant: str, secret: bytes) -> str:
    """A tenant's document is named by its content, keyed per tenant: a keyed BLAKE3 (the key derived from the
    deployment's secret and the tenant) of the token hash of its (unpadded) ids. The same content gets the same id
    within a tenant (idempotent uploads) and different ids across tenants, and nobody without the secret can compute
    an id from a guessed text (an unkeyed content hash confirmed guesses offline)."""
    if len(secret) < 32:
        raise ValueError(f"the document-id secret must hold at least 32 bytes, got {len(secret)}")
    tenant_key = blake3.blake3(b"redknot.api.tenant.v1\0" + tenant.encode(), key=secret[:32]).digest()
    return blake3.blake3(token_hash(tokens, tokenizer_fingerprint).encode(), key=tenant_key).hexdigest()[:32]


@dataclass(frozen=True)
class Binding:
    """Everything a store key depends on besides the tokens."""
    ident: ServingIdentity
    profile: ReuseProfile
    tp: int
    eos: int

    def store_key(self, tokens: list[int]) -> DocumentKey:
        """The key the store files this document's artifacts under (the same one `artifact_dir.document_key`
        derives from their certificate)."""
        padded = pad_document(tokens, self.profile.align, self.eos)
        return DocumentKey(content_hash(token_hash(padded, self.ident.tokenizer_fingerprint), len(tokens)),
                           self.ident.fingerprint,
                           profile_id(self.profile.to_dict()), self.tp)
