"""Settings of `redknot builder`: flags, then env, then defaults."""
from __future__ import annotations

import socket

from services.common.settings import CommonSettings, setting


class BuilderSettings(CommonSettings):
    metrics_listen: str = setting("127.0.0.1:9465", "REDKNOT_BUILDER_METRICS_LISTEN",
                                  "host:port of the Prometheus endpoint (empty: off)")
    consumer: str = setting(socket.gethostname(), "REDKNOT_BUILDER_CONSUMER",
                            "consumer name in the group; keep it stable across restarts to resume own jobs at once")
    # the defaults wait 1+2+...+64 s = 127 s before the last attempt: a job outlasts a store restart (4 attempts
    # dead-lettered a build after ~12 s of store outage, and the user had to upload again)
    max_attempts: int = setting(8, "REDKNOT_BUILDER_MAX_ATTEMPTS", "attempts before a job goes to the dead letters")
    backoff_s: float = setting(1.0, "REDKNOT_BUILDER_BACKOFF_S", "first retry delay; doubles per attempt")
    backoff_max_s: float = setting(120.0, "REDKNOT_BUILDER_BACKOFF_MAX_S", "longest retry delay")
    claim_idle_s: float = setting(60.0, "REDKNOT_BUILDER_CLAIM_IDLE_S",
                                  "take over another builder's job after it stayed idle this long")
    workdir: str = setting(".cache/builder", "REDKNOT_BUILDER_WORKDIR", "where rank artifacts are written "
                                                                       "before upload (removed after)")
    device: str = setting("cpu", "REDKNOT_DEVICE", "cpu (gloo) or cuda (NCCL, one GPU per rank)")
    failpoints: str = setting("", "REDKNOT_BUILDER_FAILPOINTS", "testing only: name=seconds pauses "
                                                                "(before_commit, producing)")
