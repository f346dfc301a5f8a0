"""Settings of the services, each defined once: type, default, environment variable, meaning (pydantic, at the
process edge). Precedence: command-line flag, then environment variable, then default."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runtime.policy import RuntimePolicy

if TYPE_CHECKING:
    from services.store.client import TlsConfig


def setting(default: Any, env: str, help: str):
    return Field(default, description=help, json_schema_extra={"env": env})


class Settings(BaseModel):
    """Base of every service's settings; subclasses declare fields with `setting(...)`."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    @classmethod
    def add_arguments(cls, p: argparse.ArgumentParser) -> None:
        for name, f in cls.model_fields.items():
            p.add_argument("--" + name.replace("_", "-"), default=None, dest=name,
                           help=f"{f.description} (env {f.json_schema_extra['env']}, default {f.default!r})")

    @classmethod
    def from_args(cls, args: argparse.Namespace | None = None, env: dict[str, str] | None = None, **override):
        """Flags, then env, then defaults; pydantic converts and checks the strings (a bad value is an error that
        names the setting)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name, f in cls.model_fields.items():
            flag = getattr(args, name, None) if args is not None else None
            if flag is not None:
                values[name] = flag
            elif f.json_schema_extra["env"] in env:
                values[name] = env[f.json_schema_extra["env"]]
        values.update(override)
        return cls.model_validate(values)

    def to_env(self) -> dict[str, str]:
        """These settings as environment variables (to start a child process with them)."""
        out = {}
        for name, f in type(self).model_fields.items():
            v = getattr(self, name)
            out[f.json_schema_extra["env"]] = str(v).lower() if isinstance(v, bool) else str(v)
        return out


class CommonSettings(Settings):
    """What the API, the builder and the workers must agree on."""
    redis_url: str = setting("redis://127.0.0.1:6379/0", "REDIS_URL", "Redis holding the document registry and "
                                                                       "the build queue; redis+cluster://host:port "
                                                                       "for a Redis Cluster")
    redis_prefix: str = setting("redknot", "REDKNOT_REDIS_PREFIX", "prefix of the registry and queue keys")
    tokens: str = setting("", "REDKNOT_TOKENS", "tenant=token,... (prefer --tokens-file); the store's tenants")
    tokens_file: str = setting("", "REDKNOT_TOKENS_FILE", "file of 'tenant token' lines, shared with the store")
    model: str = setting("", "REDKNOT_MODEL", "checkpoint directory (config.json, tokenizer.json, safetensors)")
    dtype: Literal["auto", "bfloat16", "float32"] = setting("auto", "REDKNOT_DTYPE", "serving dtype of the model and so of its artifacts (the "
                                                  "builder's and the workers' must match): auto (bfloat16 on CUDA, "
                                                  "float32 on CPU), bfloat16 or float32")
    profile: str = setting("demo", "REDKNOT_PROFILE", "reuse profile: a preset (demo, flash, pro, llama) or a JSON object "
                                                      "of ReuseProfile fields (the Llama family: \"preamble\": "
                                                      "[token ids] opens every request)")
    tp: int = setting(1, "REDKNOT_TP", "tensor-parallel size the artifacts are built and served for")
    cpus: int = setting(0, "REDKNOT_CPUS", "CPUs a worker's or builder's TP ranks divide among themselves for their "
                                           "torch threads (the Helm chart sets the pod's CPU limit, or its request "
                                           "where it has none; 0: the cores the process may run on; OMP_NUM_THREADS, "
                                           "where set, is each rank's count)")
    store: str = setting("127.0.0.1:50051", "REDKNOT_STORE_TARGET", "host:port of the artifact store")
    store_tls_ca: str = setting("", "REDKNOT_STORE_CLIENT_TLS_CA", "PEM CA that signed the store's certificate: talk "
                                                                  "to the store over TLS (empty: plaintext)")
    store_tls_cert: str = setting("", "REDKNOT_STORE_CLIENT_TLS_CERT", "PEM client certificate for a store that "
                                                                      "requires mTLS (with store_tls_key)")
    store_tls_key: str = setting("", "REDKNOT_STORE_CLIENT_TLS_KEY", "PEM client key for a store that requires mTLS")
    store_tls_server_name: str = setting("", "REDKNOT_STORE_CLIENT_TLS_SERVER_NAME",
                                         "name to check the store's certificate against (default: the target's host)")
    fingerprint: str = setting("", "REDKNOT_CHECKPOINT_FINGERPRINT",
                               "checkpoint fingerprint to use instead of hashing the checkpoint's bytes at start")
    policy: str = setting("", "REDKNOT_POLICY", "runtime policy: key=value,... over RuntimePolicy's measured defaults "
                                                "(runtime/policy.py: fused_min_heads, fused_min_segments, "
                                                "key_frame_min_heads, stacked_parts, moe_grouped_slots, "
                                                "prefill_chunk; empty: the defaults)")

    @field_validator("cpus")
    @classmethod
    def _cpus_not_negative(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"cpus {v} is negative (0: the cores the process may run on)")
        return v

    @field_validator("policy")
    @classmethod
    def _policy_parses(cls, v: str) -> str:
        _runtime_policy(v)                                  # a bad item is an error naming the setting, at start
        return v

    @model_validator(mode="after")
    def _store_tls_complete(self):
        if bool(self.store_tls_cert) != bool(self.store_tls_key):
            raise ValueError("store_tls_cert and store_tls_key go together (a client certificate and its key)")
        if (self.store_tls_cert or self.store_tls_server_name) and not self.store_tls_ca:
            raise ValueError("store_tls_cert and store_tls_server_name need store_tls_ca (TLS to the store)")
        return self

    def store_tls(self) -> TlsConfig | None:
        """How to reach the store: TLS (and mTLS) from the store_tls_* files, read once here; None: plaintext."""
        if not self.store_tls_ca:
            return None
        from services.store.client import TlsConfig     # here: parsing settings imports no gRPC client
        read = lambda p: Path(p).read_bytes() if p else None       # noqa: E731
        return TlsConfig(read(self.store_tls_ca), read(self.store_tls_cert), read(self.store_tls_key),
                         self.store_tls_server_name or None)

    def runtime_policy(self) -> RuntimePolicy:
        """The policy the model runs under (`Transformer.set_policy`), built once here at the process edge."""
        return _runtime_policy(self.policy)


def _runtime_policy(v: str) -> RuntimePolicy:
    return RuntimePolicy.parse([item for item in v.split(",") if item.strip()])
