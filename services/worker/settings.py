"""Settings of `redknot worker`: flags, then env, then defaults."""
from __future__ import annotations

from pydantic import model_validator

from services.common.settings import CommonSettings, setting


class WorkerSettings(CommonSettings):
    listen: str = setting("127.0.0.1:8100", "REDKNOT_WORKER_LISTEN",
                          "host:port of rank 0's HTTP endpoint (/v1/generate, /healthz, /readyz, /metrics)")
    device: str = setting("cpu", "REDKNOT_DEVICE", "cpu (gloo) or cuda (NCCL, one GPU per rank)")
    tier_gib: float = setting(16.0, "REDKNOT_WORKER_TIER_GIB", "pinned host tier capacity per rank, GiB (verified "
                                                              "documents kept in page-locked memory, LRU by bytes; "
                                                              "0: off, every request fetches from the store)")
    store_local_socket: str = setting("", "REDKNOT_WORKER_STORE_LOCAL_SOCKET",
                                      "the co-located store's local socket (its --local-socket): fetches pass blob "
                                      "file descriptors instead of streaming bytes over gRPC (empty: gRPC only)")
    layer_group: int = setting(4, "REDKNOT_WORKER_LAYER_GROUP", "layers per fetch stream")
    fetch_threads: int = setting(4, "REDKNOT_WORKER_FETCH_THREADS", "concurrent fetch streams per rank")
    shadow_fraction: float = setting(0.02, "REDKNOT_WORKER_SHADOW_FRACTION",
                                     "share of reuse-arm requests also recomputed off the critical path (after the "
                                     "answer, only while no request waits) to measure live quality: "
                                     "redknot_shadow_agreement_ratio, redknot_shadow_kl (0: off)")
    calibration_record: str = setting("", "REDKNOT_WORKER_CALIBRATION_RECORD",
                                      "a calibration record file (redknot calibrate): reuse-arm requests run only "
                                      "while it passes for this checkpoint and profile, else they recompute with the "
                                      "reason uncalibrated; read again when it changes (empty: no record required)")
    calibration_store: bool = setting(False, "REDKNOT_WORKER_CALIBRATION_STORE",
                                      "true: the calibration record comes from the artifact store instead (redknot "
                                      "calibrate --store puts it there), this checkpoint's and profile's, read again "
                                      "every calibration_poll_s; none stored closes the gate, a store that cannot be "
                                      "reached keeps the record last read (not with calibration_record)")
    calibration_poll_s: float = setting(30.0, "REDKNOT_WORKER_CALIBRATION_POLL_S",
                                        "with calibration_store: seconds between two reads of the record")
    max_running: int = setting(4, "REDKNOT_WORKER_MAX_RUNNING", "requests decoding at once, interleaved step by "
                                                                "step (each holds its KV cache on the GPU)")
    max_queue: int = setting(64, "REDKNOT_WORKER_MAX_QUEUE", "requests waiting beyond this are refused (429 with Retry-After)")
    request_timeout_s: float = setting(600.0, "REDKNOT_WORKER_REQUEST_TIMEOUT_S", "longest wait for one request")
    failpoints: str = setting("", "REDKNOT_WORKER_FAILPOINTS", "testing only: name=seconds pauses (before_fetch: "
                              "a reuse request is taken, nothing fetched yet; after_fetch: a request's shards are in "
                              "the tier, its answer not yet sent)")

    @model_validator(mode="after")
    def _one_calibration_source(self):
        if self.calibration_store and self.calibration_record:
            raise ValueError("calibration_store and calibration_record are two sources of one record: choose one")
        if self.calibration_poll_s <= 0:
            raise ValueError(f"calibration_poll_s {self.calibration_poll_s!r} is not positive")
        return self
