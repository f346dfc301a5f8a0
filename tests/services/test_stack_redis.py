"""The local stack's Redis (`make demo`, the service tests, bench/serve_ttft.py) keeps what it acknowledged: a
SIGKILL and a restart of the real redis-server on loopback lose no write (issue 33: without persistence one restart
lost the registry, the build queue and the store's index)."""
from __future__ import annotations

import redis

from .conftest import started_redis_service


def test_a_killed_and_restarted_redis_keeps_every_acknowledged_write(tmp_path):
    rs, port = started_redis_service(tmp_path)
    try:
        with redis.Redis(port=port) as r:
            for i in range(200):
                r.hset(f"rk:doc:{i}", mapping={"status": "ready", "generation": i})
            r.rpush("rk:queue", *[f"job{i}" for i in range(50)])
        rs.kill()                               # SIGKILL right after the last acknowledged write: no shutdown save
        rs.start(tmp_path)
        rs.wait_ready(30)
        with redis.Redis(port=port, decode_responses=True) as r:
            assert all(r.hgetall(f"rk:doc:{i}") == {"status": "ready", "generation": str(i)} for i in range(200))
            assert r.lrange("rk:queue", 0, -1) == [f"job{i}" for i in range(50)]
            assert r.config_get("appendfsync") == {"appendfsync": "always"}
    finally:
        rs.stop()
