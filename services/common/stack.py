"""The embedded default: every service of RedKnot-MLA as a child process on loopback, for `redknot demo` and
the service tests. Redis (a redis-server of our own unless a URL is given), the artifact store on filesystem
blobs, the API, the builder and a TP worker; each with its own log file, each started in its own session so
that stopping a service also stops its rank processes. Every wait is bounded."""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import redis

from services.api.settings import ApiSettings
from services.builder.settings import BuilderSettings
from services.store.redis_client import sync_client
from services.worker.settings import WorkerSettings

START_TIMEOUT_S = 240.0


# what a child says when the port it was given was taken first: redis-server ("bind: Address already in use"),
# Python servers ("[Errno 98] ... address already in use"), prometheus ("bind: address already in use")
ADDR_IN_USE = re.compile(r"address already in use|errno 98", re.IGNORECASE)
PORT_TRIES = 5


def free_port() -> int:
    """A port free now; a server given it may find it taken when it binds (`LocalStack.start` then tries fresh ones)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def redis_ok(url: str) -> bool:
    try:
        return bool(sync_client(url, socket_connect_timeout=1, socket_timeout=2).ping())
    except redis.RedisError:
        return False


def redis_is(url: str, pid: int) -> bool:
    """The Redis answering at `url` is process `pid` (not another server that took the port first)."""
    try:
        return sync_client(url, socket_connect_timeout=1, socket_timeout=2).info("server")["process_id"] == pid
    except redis.RedisError:
        return False


def grpc_serving(target: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(target) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
            return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


try:   # loaded here, in the parent: the forked child must not import or dlopen (locks held by other threads)
    import ctypes
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None
# util-linux's setpriv sets the same death signal in the child and execs the service, so Popen needs no preexec_fn:
# with one, CPython must fork() (not vfork), which runs grpc's pthread_atfork handler, and that handler can block
# for ever while this process holds live gRPC channels (a CI run hung there, in the test process's fork)
_SETPRIV = shutil.which("setpriv")


def _die_with_parent() -> None:
    # Linux: a service gets SIGTERM (and stops cleanly) if whoever started it dies without stopping it.
    # Runs in the child between fork and exec, so it only makes the one prepared call.
    if _PRCTL is not None:
        _PRCTL(1, 15)                                                  # PR_SET_PDEATHSIG, SIGTERM


class StackError(RuntimeError):
    """A service did not start, or exited; the message carries the end of its log."""


@dataclass
class Service:
    name: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    ready: object                               # () -> bool
    proc: subprocess.Popen | None = None
    log_offset: int = 0                         # where this run's output starts in the (appended) log

    def start(self, cwd: Path) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        cmd, pre = ([_SETPRIV, "--pdeathsig", "TERM", "--", *self.cmd], None) if _SETPRIV else \
            (self.cmd, _die_with_parent)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **self.env}, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=pre)

    def log(self, tail: int = 4000) -> str:
        """The end of this run's output."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")[-tail:]
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if not self.alive():
                raise StackError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise StackError(f"{self.name} not ready after {timeout:.0f}s:\n{self.log()}")
            time.sleep(0.1)

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)       # its own session: the service and its rank processes
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL the service and its ranks: no cleanup runs."""
        if self.proc is None:
            return
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; the exit code (None if it had to be killed)."""
        if self.proc is None:
            return None
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        return self.proc.returncode


@dataclass
class StackConfig:
    workdir: Path
    model: Path
    tp: int = 1
    profile: str = "demo"
    device: str = "cpu"
    redis_url: str = ""                          # empty: start a redis-server of our own
    prefix: str = "redknot"
    tenants: dict[str, str] = field(default_factory=lambda: {"demo": "demo-" + secrets.token_hex(16)})
    id_secret: str = field(default_factory=lambda: secrets.token_hex(32))     # the API's key of document ids
    store_env: dict[str, str] = field(default_factory=dict)
    api_env: dict[str, str] = field(default_factory=dict)
    builder_env: dict[str, str] = field(default_factory=dict)
    worker_env: dict[str, str] = field(default_factory=dict)
    # the worker fetches from the co-located store through its local socket (gRPC stays for everything else)
    local_socket: bool = True
    tier_gib: float = 4.0                        # the worker's pinned host tier, per rank


def redis_service(port: int, data_dir: Path, log: Path) -> Service:
    """A redis-server of our own on loopback, serving redis://127.0.0.1:port/0. Every write is appended to its AOF in
    `data_dir` and fsynced before Redis answers (`appendfsync always`, as the chart's Redis keeps an AOF): a SIGKILL
    or a restart of Redis loses no acknowledged registry record, queue entry or index entry (without persistence
    one restart lost all of them and left the store's blobs unreachable by garbage collection)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise StackError("no redis-server on PATH: install it (apt-get install redis-server) or give a "
                         "Redis URL (REDIS_URL)")
    data_dir.mkdir(parents=True, exist_ok=True)
    url = f"redis://127.0.0.1:{port}/0"
    svc = Service("redis", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
                            "--appendfsync", "always", "--dir", str(data_dir)], {"PYTHONUNBUFFERED": "1"}, log, None)
    svc.ready = lambda: svc.proc is not None and redis_is(url, svc.proc.pid)     # ours, not a server on its port
    return svc


def store_service(listen: str, metrics_listen: str, redis_url: str, redis_prefix: str, blob_root: Path,
                  tokens_file: Path, log: Path, local_socket: str = "") -> Service:
    """`redknot store serve` on filesystem blobs, ready once its gRPC health service answers SERVING."""
    env = {"PYTHONUNBUFFERED": "1", "REDIS_URL": redis_url, "REDKNOT_STORE_REDIS_PREFIX": redis_prefix,
           "REDKNOT_STORE_BLOB_ROOT": str(blob_root), "REDKNOT_STORE_TOKENS_FILE": str(tokens_file),
           "REDKNOT_STORE_LOCAL_SOCKET": local_socket}
    return Service("store", [sys.executable, "-m", "services.cli", "store", "serve", "--listen", listen,
                             "--metrics-listen", metrics_listen], env, log, lambda: grpc_serving(listen))


class LocalStack:
    def __init__(self, cfg: StackConfig):
        self.cfg = cfg
        self.workdir = Path(cfg.workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tokens_file = self.workdir / "tokens"
        self.tokens_file.write_text("".join(f"{t} {tok}\n" for t, tok in cfg.tenants.items()))
        self.tokens_file.chmod(0o600)
        self.local_socket = ""
        if cfg.local_socket:        # a unix socket's path has at most 107 bytes: a short one where the workdir's is long
            sock = self.workdir / "store.sock"
            self.local_socket = str(sock if len(str(sock)) < 100 else
                                    Path(tempfile.mkdtemp(prefix="rk-")) / "store.sock")
        self._pick_ports()

    def _pick_ports(self) -> None:
        """Fresh ports for every service, wired into each other's settings (the services are defined anew)."""
        self.ports = {n: free_port() for n in ("redis", "store", "store_metrics", "api", "worker", "builder_metrics")}
        self.redis_url = self.cfg.redis_url or f"redis://127.0.0.1:{self.ports['redis']}/0"
        self.services: dict[str, Service] = {}
        self._define()

    # ------------------------------------------------------------------------------------------- urls
    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['api']}"

    @property
    def worker_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['worker']}"

    @property
    def store_target(self) -> str:
        return f"127.0.0.1:{self.ports['store']}"

    def metrics_targets(self) -> dict[str, str]:
        """host:port of every /metrics endpoint, by service."""
        p = self.ports
        return {"api": f"127.0.0.1:{p['api']}", "worker": f"127.0.0.1:{p['worker']}",
                "store": f"127.0.0.1:{p['store_metrics']}", "builder": f"127.0.0.1:{p['builder_metrics']}"}

    # ------------------------------------------------------------------------------------------- define
    def _define(self) -> None:
        c, p, logs = self.cfg, self.ports, self.workdir / "logs"
        py = [sys.executable, "-m", "services.cli"]
        base = {"PYTHONUNBUFFERED": "1"}
        if not c.redis_url:
            self.services["redis"] = redis_service(p["redis"], self.workdir / "redis", logs / "redis.log")
        common = dict(redis_url=self.redis_url, redis_prefix=c.prefix, tokens_file=str(self.tokens_file),
                      model=str(Path(c.model).resolve()), profile=c.profile, tp=c.tp, store=self.store_target)
        self.services["store"] = store_service(self.store_target, f"127.0.0.1:{p['store_metrics']}", self.redis_url,
                                               f"{c.prefix}-store", self.workdir / "store", self.tokens_file,
                                               logs / "store.log", self.local_socket)
        self.services["store"].env.update(c.store_env)
        api = ApiSettings(**common, listen=f"127.0.0.1:{p['api']}", worker_url=self.worker_url, id_secret=c.id_secret)
        self.services["api"] = Service("api", py + ["api", "serve"], {**base, **api.to_env(), **c.api_env},
                                       logs / "api.log",
                                       lambda: http_ok(self.api_url + "/healthz"))
        builder = BuilderSettings(**common, metrics_listen=f"127.0.0.1:{p['builder_metrics']}", consumer="builder-0",
                                  workdir=str(self.workdir / "builder"), device=c.device)
        self.services["builder"] = Service(
            "builder", py + ["builder"], {**base, **builder.to_env(), **c.builder_env}, logs / "builder.log",
            lambda: "redknot builder: consuming" in self.services["builder"].log(100_000))
        worker = WorkerSettings(**common, listen=f"127.0.0.1:{p['worker']}", device=c.device,
                                tier_gib=c.tier_gib, store_local_socket=self.local_socket)
        self.services["worker"] = Service(
            "worker", py + ["worker"], {**base, **worker.to_env(), **c.worker_env}, logs / "worker.log",
            lambda: http_ok(self.worker_url + "/readyz"))

    # ------------------------------------------------------------------------------------------- control
    def start(self, progress=None, defer: tuple[str, ...] = ()) -> "LocalStack":
        """Redis and the store first (the others need them), then the API, builder and worker together; the services
        named in `defer` are left for a later `restart(name)` (a benchmark builds its documents before a worker
        that needs the same GPU exists). The ports are picked free before any service binds one and wired into
        each other's settings: where another process took one first (the service says "address already in use"),
        what started is stopped and the stack starts again on fresh ports (PORT_TRIES in all)."""
        unknown = set(defer) - set(self.services)
        if unknown:
            raise ValueError(f"cannot defer {sorted(unknown)}: not services of this stack")
        for attempt in range(PORT_TRIES):
            try:
                return self._start(progress, defer)
            except StackError as e:
                if attempt == PORT_TRIES - 1 or not ADDR_IN_USE.search(str(e)):
                    raise
                self._pick_ports()

    def _start(self, progress, defer: tuple[str, ...]) -> "LocalStack":
        try:
            for group in (("redis", "store"), ("api", "builder", "worker")):
                names = [n for n in group if n in self.services and n not in defer]
                for n in names:
                    self.services[n].start(self.workdir)
                for n in names:
                    self.services[n].wait_ready()
                    if progress is not None:
                        progress(n)
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, name: str, env: dict[str, str] | None = None) -> None:
        svc = self.services[name]
        if svc.alive():
            svc.stop()
        if env is not None:
            svc.env = {**svc.env, **env}
        svc.start(self.workdir)
        svc.wait_ready()

    def stop(self) -> dict[str, int | None]:
        """Stop every service, callers of others first; exit codes by service."""
        codes = {}
        for n in ("api", "worker", "builder", "store", "redis"):
            if n in self.services:
                codes[n] = self.services[n].stop()
        return codes

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
