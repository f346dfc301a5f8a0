"""The one place every service builds its Redis client from a URL, sync or asyncio.

`redis://` and `rediss://` (and `unix://`) give the plain client, as before. `redis+cluster://host:port` and
`rediss+cluster://host:port` give redis-py's RedisCluster, which discovers the other nodes from that seed. Nothing
else changes between the two: every multi-key script or transaction of the store index, the registry and the build
queue names keys of one hash tag, so it runs on one slot (`tests/services/test_redis_cluster.py` proves both)."""
from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def cluster_url(url: str) -> str | None:
    """The plain URL redis-py's RedisCluster takes when `url` names a cluster, else None."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme in CLUSTER_SCHEMES:
        return f"{CLUSTER_SCHEMES[scheme]}://{rest}"
    return None


def sync_client(url: str, **kw) -> redis.Redis | RedisCluster:
    """For the API, the builder, the stack and tests (the registry and the build queue)."""
    plain = cluster_url(url)
    return RedisCluster.from_url(plain, **kw) if plain else redis.Redis.from_url(url, **kw)


def async_client(url: str, max_connections: int, **kw) -> aioredis.Redis | AsyncRedisCluster:
    """For the store index. On a single Redis a blocking pool: beyond `max_connections` a call waits for a
    connection. On a cluster the bound is per node and a call beyond it fails with a ConnectionError, which the
    store answers UNAVAILABLE (retryable): redis-py's cluster pools do not wait."""
    plain = cluster_url(url)
    if plain:
        return AsyncRedisCluster.from_url(plain, max_connections=max_connections, **kw)
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=30, **kw)
    return aioredis.Redis(connection_pool=pool)
