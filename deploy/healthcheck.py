#!/usr/bin/env python3
"""Container health check (the images' HEALTHCHECK, installed as /usr/local/bin/redknot-healthcheck).

One target, from the first argument or REDKNOT_HEALTHCHECK:
  http://host:port/path   healthy when the GET answers 2xx within the timeout (the API's /healthz, a
                          worker's or builder's endpoint, the store's /metrics)
  grpc://host:port        healthy when the standard gRPC health service answers SERVING (the artifact store)
Exit 0 healthy, 1 unhealthy; one line on stdout says why. The timeout is REDKNOT_HEALTHCHECK_TIMEOUT_S (3)."""
from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def check_http(url: str, timeout: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300, f"{url}: HTTP {r.status}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"{url}: {e}"


def check_grpc(target: str, timeout: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(target) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as e:
            return False, f"grpc://{target}: {e.code().name}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    return r.status == health_pb2.HealthCheckResponse.SERVING, f"grpc://{target}: {name}"


def main(argv: list[str]) -> int:
    target = argv[1] if len(argv) > 1 else os.environ.get("REDKNOT_HEALTHCHECK", "")
    timeout = float(os.environ.get("REDKNOT_HEALTHCHECK_TIMEOUT_S", "3"))
    if target.startswith(("http://", "https://")):
        ok, why = check_http(target, timeout)
    elif target.startswith("grpc://"):
        ok, why = check_grpc(target[len("grpc://"):], timeout)
    else:
        ok, why = False, f"no target: set REDKNOT_HEALTHCHECK to http://... or grpc://... (got {target!r})"
    print(("healthy: " if ok else "unhealthy: ") + why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
