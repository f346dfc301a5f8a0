"""Settings of `redknot store serve`, each defined once: type, default, environment variable, meaning.
Precedence: command-line flag, then environment variable, then default."""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field


_TYPES = {"str": str, "int": int, "float": float}      # field annotations are strings (postponed evaluation)
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")   # keys.check_tenant's rule (this module imports no keys)


def _s(default, env: str, help: str):
    return field(default=default, metadata={"env": env, "help": help})


@dataclass(frozen=True)
class Settings:
    listen: str = _s("127.0.0.1:50051", "REDKNOT_STORE_LISTEN", "host:port of the gRPC server")
    redis_url: str = _s("redis://127.0.0.1:6379/0", "REDIS_URL",
                        "Redis holding the index; redis+cluster://host:port (or rediss+cluster://) for a Redis Cluster")
    redis_connections: int = _s(64, "REDKNOT_STORE_REDIS_CONNECTIONS",
                                "most index connections per process (on a Redis Cluster: per node)")
    redis_prefix: str = _s("redknot", "REDKNOT_STORE_REDIS_PREFIX", "prefix of every index key")
    backend: str = _s("fs", "REDKNOT_STORE_BACKEND", "blob backend: fs (local filesystem) or s3")
    blob_root: str = _s(".cache/store", "REDKNOT_STORE_BLOB_ROOT",
                        "fs: blob directory; s3: local spool directory for uploads")
    s3_endpoint: str = _s("", "REDKNOT_STORE_S3_ENDPOINT", "s3: endpoint URL (empty: AWS)")
    s3_bucket: str = _s("redknot-artifacts", "REDKNOT_STORE_S3_BUCKET", "s3: bucket (created if missing)")
    s3_prefix: str = _s("", "REDKNOT_STORE_S3_PREFIX", "s3: object key prefix")
    s3_region: str = _s("us-east-1", "REDKNOT_STORE_S3_REGION", "s3: region")
    tokens: str = _s("", "REDKNOT_STORE_TOKENS", "tenant=token,... (prefer --tokens-file)")
    tokens_file: str = _s("", "REDKNOT_STORE_TOKENS_FILE", "file of 'tenant token' lines")
    admin_tenants: str = _s("", "REDKNOT_STORE_ADMIN_TENANTS",
                            "comma-separated tenants whose tokens may write deployment-wide state: the calibration "
                            "records (PutCalibration; every tenant reads them). Empty: no tenant may")
    tls_cert: str = _s("", "REDKNOT_STORE_TLS_CERT", "PEM server certificate (enables TLS)")
    tls_key: str = _s("", "REDKNOT_STORE_TLS_KEY", "PEM server key")
    tls_client_ca: str = _s("", "REDKNOT_STORE_TLS_CLIENT_CA", "PEM CA of client certificates (enables mTLS)")
    metrics_listen: str = _s("127.0.0.1:9464", "REDKNOT_STORE_METRICS_LISTEN",
                             "host:port of the Prometheus endpoint (empty: off)")
    max_shard_bytes: int = _s(1 << 30, "REDKNOT_STORE_MAX_SHARD_BYTES", "largest shard accepted")
    max_shards_per_generation: int = _s(16384, "REDKNOT_STORE_MAX_SHARDS", "most shards in one generation")
    upload_ttl_s: float = _s(3600.0, "REDKNOT_STORE_UPLOAD_TTL_S", "an uncommitted upload is dropped after this")
    spool_stale_s: float = _s(3600.0, "REDKNOT_STORE_SPOOL_STALE_S",
                              "GC removes spool files untouched this long (abandoned uploads)")
    grace_s: float = _s(10.0, "REDKNOT_STORE_GRACE_S", "on SIGTERM, in-flight RPCs get this long to finish")
    stream_idle_s: float = _s(60.0, "REDKNOT_STORE_STREAM_IDLE_S",
                              "a PutShards or FetchShards stream that moves no message this long ends with "
                              "DEADLINE_EXCEEDED (0: no bound)")
    stream_deadline_s: float = _s(3600.0, "REDKNOT_STORE_STREAM_DEADLINE_S",
                                  "a PutShards or FetchShards stream still open this long after it began ends with "
                                  "DEADLINE_EXCEEDED (0: no bound)")
    gc_interval_s: float = _s(900.0, "REDKNOT_STORE_GC_INTERVAL_S",
                              "collect garbage of every tenant this often: expired uploads' pins, unreferenced "
                              "blobs, stale spool files (0: only on CollectGarbage calls)")
    redis_health_check_s: float = _s(5.0, "REDKNOT_STORE_REDIS_HEALTH_CHECK_S",
                                     "a pooled index connection idle this long is pinged before it is used")
    local_socket: str = _s("", "REDKNOT_STORE_LOCAL_SOCKET",
                           "fs backend: also serve fetches to co-located readers on this Unix socket path, as open "
                           "blob descriptors (empty: off)")
    local_socket_mode: str = _s("0600", "REDKNOT_STORE_LOCAL_SOCKET_MODE",
                                "file mode of the local socket: 0600 (the store's user) or 0660 (and its group)")
    local_socket_timeout_s: float = _s(60.0, "REDKNOT_STORE_LOCAL_SOCKET_TIMEOUT_S",
                                       "local socket: a connection idle, or not reading its answer, this long is "
                                       "closed")
    failpoints: str = _s("", "REDKNOT_STORE_FAILPOINTS", "testing only: comma-separated points to stop at for "
                                                       "good (put.after_shard, commit.before_script, "
                                                       "commit.after_script)")

    def __post_init__(self):
        if self.backend not in ("fs", "s3"):
            raise ValueError(f"backend {self.backend!r} is not fs or s3")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.local_socket and self.backend != "fs":
            raise ValueError("--local-socket passes blob files: it needs the fs backend")
        if self.local_socket_mode not in ("0600", "0660"):
            raise ValueError(f"--local-socket-mode {self.local_socket_mode!r} is not 0600 or 0660")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        for a in self.admins():
            if not _TENANT.match(a):
                raise ValueError(f"--admin-tenants: {a!r} is not a tenant name ({_TENANT.pattern})")
        for name in ("stream_idle_s", "stream_deadline_s", "gc_interval_s", "redis_health_check_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)!r} is negative")

    def admins(self) -> frozenset[str]:
        return frozenset(a.strip() for a in self.admin_tenants.split(",") if a.strip())

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(Settings):
            p.add_argument("--" + f.name.replace("_", "-"), type=_TYPES[f.type], default=None,
                           help=f"{f.metadata['help']} (env {f.metadata['env']}, default {f.default!r})")

    @staticmethod
    def from_args(args: argparse.Namespace | None = None, env: dict[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        values = {}
        for f in dataclasses.fields(Settings):
            typ = _TYPES[f.type]
            flag = getattr(args, f.name, None) if args is not None else None
            if flag is not None:
                values[f.name] = flag
            elif f.metadata["env"] in env:
                values[f.name] = typ(env[f.metadata["env"]])
        return Settings(**values)
