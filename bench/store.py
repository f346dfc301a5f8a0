"""Shard fetch throughput of the artifact store against a plain Redis GET of the same bytes and a direct read
of the blob file, for 1, 4 and 64 MiB shards (a benchmark, not a test).

    .venv/bin/python bench/store.py [--sizes 1,4,64] [--total-mib 256] [--repeat 5] [--json out.json]

Starts `redknot store serve` (filesystem backend, blobs in a temp dir, `--local-socket` on) on loopback against
REDIS_URL, else 127.0.0.1:6379, else a `redis-server` of its own on a free port; commits one generation of
`total-mib` per shard size, then times, per size, best of `repeat` passes over every shard:
- store fetch: one FetchShards stream through the typed client (server verifies each digest before the
  shard's last chunk, the client verifies it again), over gRPC on loopback; and the same with the client's
  second check off (`verify=False`);
- local fetch: the same selection over the store's local socket (`LocalStoreClient` with its defaults: the
  store passes open blob descriptors, the client reads them and verifies every digest); a second table times
  its settings (shards read at once, blake3's own threads on or off);
- Redis GET: redis-py GET of the same bytes, stored under temporary keys;
- direct read: open + read of the blob files (page cache warm), and the same plus a blake3 check.
Everything runs on this machine; the table goes to stdout (and JSON with --json)."""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from services.store.client import StoreClient  # noqa: E402
from services.store.local_client import LocalStoreClient  # noqa: E402
from services.store.keys import DocumentKey, Range, ShardKind, ShardSpec, digest_bytes  # noqa: E402
from services.store.memory import tune_malloc  # noqa: E402
from bench.report import write_json  # noqa: E402

TOKEN = "bench-token-0123456789abcdef"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(tmp: Path) -> tuple[subprocess.Popen | None, str]:
    """REDIS_URL's server is used as given; without one, 127.0.0.1:6379 if it answers, else our own."""
    try:
        redis.Redis.from_url(DEFAULT_REDIS, socket_connect_timeout=1).ping()
        return None, DEFAULT_REDIS
    except redis.RedisError:
        pass
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("no Redis: set REDIS_URL, run one on 127.0.0.1:6379, or put redis-server on PATH")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 30
    while True:
        try:
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
            return proc, url
        except redis.RedisError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("redis-server did not start") from None
            time.sleep(0.05)


def start_store(tmp: Path, redis_url: str, prefix: str) -> tuple[subprocess.Popen, str]:
    (tmp / "tokens").write_text(f"bench {TOKEN}\n")
    port = free_port()
    env = dict(os.environ, REDIS_URL=redis_url, REDKNOT_STORE_REDIS_PREFIX=prefix,
               REDKNOT_STORE_BLOB_ROOT=str(tmp / "blobs"), REDKNOT_STORE_TOKENS_FILE=str(tmp / "tokens"),
               REDKNOT_STORE_METRICS_LISTEN="", REDKNOT_STORE_MAX_SHARD_BYTES=str(1 << 30),
               REDKNOT_STORE_LOCAL_SOCKET=str(tmp / "store.sock"))
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "store", "serve", "--listen", f"127.0.0.1:{port}"],
                            cwd=ROOT, env=env, stdout=open(tmp / "store.log", "wb"), stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    with StoreClient(target, TOKEN, timeout_s=2) as c:
        while True:
            try:
                c.list_documents()
                return proc, target
            except Exception:       # noqa: BLE001 - not up yet
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("store did not start:\n" + (tmp / "store.log").read_text()[-2000:])
                time.sleep(0.1)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,4,64", help="shard sizes in MiB")
    ap.add_argument("--total-mib", type=int, default=256, help="bytes fetched per pass, per size")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                    help="default: 127.0.0.1:6379 if it answers, else a redis-server started here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tune_malloc()           # the client side of the fetch does what a worker should do (services/store/memory.py)

    tmp = Path(tempfile.mkdtemp(prefix="redknot-bench-store-"))
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    redis_proc, redis_url = (None, args.redis_url) if args.redis_url else start_redis(tmp)
    r = redis.Redis.from_url(redis_url)
    proc, target = start_store(tmp, redis_url, prefix)
    rows = []
    try:
        with StoreClient(target, TOKEN) as client, LocalStoreClient(tmp / "store.sock", TOKEN) as local:
            many = max(2, min(8, (os.cpu_count() or 1) // 2))
            variants = [(1, False), (1, True), (many, False), (many, True)]
            for mib in (int(x) for x in args.sizes.split(",")):
                size, n = mib << 20, max(1, args.total_mib // mib)
                key = DocumentKey(digest_bytes(f"bench {mib}".encode()), digest_bytes(b"ckpt"), "bench", 1)
                cert = b"certificate"
                shards = [(ShardSpec("certificate.msgpack", 0, ShardKind.CERTIFICATE, digest_bytes(cert), len(cert)),
                           cert)]
                for i in range(n):
                    data = os.urandom(size)
                    shards.append((ShardSpec(f"layer{i:02d}.latent.safetensors", 0, ShardKind.LATENT,
                                             digest_bytes(data), size, Range(i, i + 1)), data))
                client.put_generation(key, shards)
                names = [s.name for s, _ in shards[1:]]
                total = n * size
                paths = [next((tmp / "blobs" / "blobs").rglob(s.digest)) for s, _ in shards[1:]]
                rkeys = [f"{prefix}:get:{i}" for i in range(n)]
                for k, (_, data) in zip(rkeys, shards[1:]):
                    r.set(k, data)
                del shards

                def fetch():
                    got = sum(len(s.data) for s in client.fetch(key, 0, names=names))
                    assert got == total, got

                def fetch_server_verified():
                    got = sum(len(s.data) for s in client.fetch(key, 0, names=names, verify=False))
                    assert got == total, got

                def local_fetch():
                    got = sum(len(s.data) for s in local.fetch(key, 0, names=names))
                    assert got == total, got

                def redis_get():
                    assert sum(len(r.get(k)) for k in rkeys) == total

                def direct():
                    for p in paths:
                        with open(p, "rb") as f:
                            f.read()

                def direct_verified():
                    for p in paths:
                        with open(p, "rb") as f:
                            assert digest_bytes(f.read()) == p.name

                fetch()                     # warm: page cache, connections
                local_fetch()
                row = {"shard_mib": mib, "shards": n, "total_mib": total >> 20,
                       "store_fetch_gbps": gbps(total, best_of(args.repeat, fetch)),
                       "store_fetch_server_verified_gbps": gbps(total, best_of(args.repeat, fetch_server_verified)),
                       "local_fetch_gbps": gbps(total, best_of(args.repeat, local_fetch)),
                       "redis_get_gbps": gbps(total, best_of(args.repeat, redis_get)),
                       "direct_read_gbps": gbps(total, best_of(args.repeat, direct)),
                       "direct_read_blake3_gbps": gbps(total, best_of(args.repeat, direct_verified))}
                row["vs_redis"] = row["store_fetch_gbps"] / row["redis_get_gbps"]
                row["vs_direct"] = row["store_fetch_gbps"] / row["direct_read_gbps"]
                row["vs_direct_blake3"] = row["store_fetch_gbps"] / row["direct_read_blake3_gbps"]
                row["local_variants_gbps"] = {}
                for threads, parallel_hash in variants:
                    with LocalStoreClient(tmp / "store.sock", TOKEN, threads=threads,
                                          parallel_hash=parallel_hash) as lc:
                        def variant(lc=lc):
                            assert sum(len(s.data) for s in lc.fetch(key, 0, names=names)) == total
                        row["local_variants_gbps"][f"threads={threads} parallel_hash={parallel_hash}"] = \
                            gbps(total, best_of(args.repeat, variant))
                row["local_vs_redis"] = row["local_fetch_gbps"] / row["redis_get_gbps"]
                row["local_vs_direct"] = row["local_fetch_gbps"] / row["direct_read_gbps"]
                row["local_vs_direct_blake3"] = row["local_fetch_gbps"] / row["direct_read_blake3_gbps"]
                rows.append(row)
                r.delete(*rkeys)
                client.retire(key, 1)
                client.collect_garbage(key)
                print(f"  {mib} MiB shards done", file=sys.stderr, flush=True)
    finally:
        proc.kill()
        proc.wait(10)
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait(10)
        else:
            keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
            if keys:
                r.delete(*keys)
        shutil.rmtree(tmp, ignore_errors=True)

    head = ("| shard | shards | gRPC fetch GB/s | gRPC fetch, server-verified only GB/s | local fetch GB/s "
            "| Redis GET GB/s | direct read GB/s | direct read + blake3 GB/s | gRPC / Redis | gRPC / direct "
            "| local / Redis | local / direct | local / direct+blake3 |")
    print(head)
    print("| ---: " * 13 + "|")
    for w in rows:
        print(f"| {w['shard_mib']} MiB | {w['shards']} | {w['store_fetch_gbps']:.2f} "
              f"| {w['store_fetch_server_verified_gbps']:.2f} | {w['local_fetch_gbps']:.2f} "
              f"| {w['redis_get_gbps']:.2f} "
              f"| {w['direct_read_gbps']:.2f} | {w['direct_read_blake3_gbps']:.2f} | {w['vs_redis']:.2f}x "
              f"| {w['vs_direct']:.0%} | {w['local_vs_redis']:.2f}x | {w['local_vs_direct']:.0%} "
              f"| {w['local_vs_direct_blake3']:.0%} |")
    print(f"\nlocal fetch GB/s by LocalStoreClient setting (default here: threads={local.threads} "
          f"parallel_hash={local.parallel_hash})")
    names = list(rows[0]["local_variants_gbps"]) if rows else []
    print("| shard | " + " | ".join(names) + " |")
    print("| ---: " * (len(names) + 1) + "|")
    for w in rows:
        print(f"| {w['shard_mib']} MiB | " + " | ".join(f"{w['local_variants_gbps'][n]:.2f}" for n in names) + " |")
    write_json(args.json, {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "python": platform.python_version(), "rows": rows}, args, "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
