"""The worker's calibration gate on the reuse arm (issue 31): with a record file configured
(`REDKNOT_WORKER_CALIBRATION_RECORD`, a record `redknot calibrate` wrote; in Kubernetes a mounted ConfigMap or
Secret), reuse-arm requests run only while that file holds a record that passes for this worker's checkpoint and
profile (`runtime.eval.calibrate.check_record`); otherwise they recompute with the reason `uncalibrated`, counted
with the other fallbacks. The file is read again when it changes, at most every `WATCH_S` seconds, so a new record
takes effect without a restart; a file that cannot be read or parsed closes the gate (and says why). No file
configured: nothing is required and the gate is open. Rank 0 decides for its whole TP group (`Job.uncalibrated`)."""
from __future__ import annotations

import json
import logging
import os
import time

from runtime.eval.calibrate import check_record
from runtime.reuse.profile import ReuseProfile

log = logging.getLogger("redknot.worker")
WATCH_S = 2.0


class CalibrationGate:
    def __init__(self, path: str, fingerprint: str, profile: ReuseProfile):
        self.path, self.fingerprint, self.profile = path, fingerprint, profile
        self._stamp: tuple | None = None
        self._next = 0.0
        self.record: dict | None = None
        self.problem = ""                  # why the file gave no record ("" when it did, or none is configured)
        self._read()

    @property
    def required(self) -> bool:
        return bool(self.path)

    def _read(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError as e:
            self._stamp, self.record, self.problem = None, None, f"calibration record {self.path}: {e.strerror}"
            return
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            with open(self.path) as f:
                record = json.load(f)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            self.record, self.problem = None, f"calibration record {self.path} cannot be read: {e}"
            log.error("%s", self.problem)
            return
        self.record, self.problem = record, ""
        log.info("calibration record %s read (passed: %s)", self.path, record.get("passed"))

    def reason(self) -> str | None:
        """None when the reuse arm may run; else why not (the detail of an `uncalibrated` fallback)."""
        if not self.required:
            return None
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + WATCH_S
            self._read()
        if self.record is None:
            return self.problem or "no calibration record"
        ok, why = check_record(self.record, self.fingerprint, self.profile)
        return None if ok else why

    def describe(self) -> dict:
        """What the worker's /calibration shows: whether a record is required, the record in force, the verdict."""
        why = self.reason()
        return {"required": self.required, "path": self.path or None, "record": self.record,
                "serves_reuse": why is None, "reason": why}
