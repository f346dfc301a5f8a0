"""The worker's calibration gate on the reuse arm (issue 31): reuse-arm requests run only while the calibration record
in force passes for this worker's checkpoint and profile (`runtime.eval.calibrate.check_record`); otherwise they
recompute with the reason `uncalibrated`, counted with the other fallbacks. Rank 0 decides for its whole TP group
(`Job.uncalibrated`). The record comes from one of two sources:

- a file (`REDKNOT_WORKER_CALIBRATION_RECORD`, a record `redknot calibrate` wrote; in Kubernetes a mounted
  ConfigMap): looked at, at most every `WATCH_S` seconds, on a request, and read again when it changed; a file that
  cannot be read or parsed closes the gate (and says why);
- the artifact store (`REDKNOT_WORKER_CALIBRATION_STORE`; `redknot calibrate --store` put the record there): a
  thread reads this worker's (fingerprint, profile) record every `calibration_poll_s`, off the request path, so a
  new record takes effect without a restart. No record stored, or one that cannot be parsed, closes the gate; a
  store that cannot be reached (or refuses) keeps the record last read in force, and `describe()` says so.

No source configured: nothing is required and the gate is open. The gate also gives the record's lower bound of
teacher-forced top-1 agreement (`agreement_lower_bound`), which the worker exports for the shadow-agreement alert."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from runtime.eval.calibrate import check_record
from runtime.reuse.profile import ReuseProfile
from services.store.calibration import CalibrationKey
from services.store.client import StoreClient, TlsConfig
from services.store.errors import DataLoss, NotFound, StoreError

log = logging.getLogger("redknot.worker")
WATCH_S = 2.0
STORE_TIMEOUT_S = 10.0


def _when(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, timezone.utc).isoformat(timespec="seconds")


class RecordFile:
    """A record file, looked at on a request at most every WATCH_S seconds and read again when it changed."""

    def __init__(self, path: str):
        self.path = path
        self._stamp: tuple | None = None
        self._next = 0.0
        self.record: dict | None = None
        self.problem = ""                  # why the file gave no record ("" when it did)
        self._read()

    def current(self) -> tuple[dict | None, str]:
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + WATCH_S
            self._read()
        return self.record, self.problem

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

    def describe(self) -> dict:
        return {"source": "file", "path": self.path}

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class _StoreRead:
    """What the last reads of the store left: the record in force and how it came."""
    record: dict | None = None
    problem: str = "no calibration record read from the store yet"     # why there is no record ("" when there is)
    read_at: float = 0.0           # Unix time of the last read that answered (0: none yet)
    stored_at_unix_ms: int = 0
    stored_by: str = ""
    digest: str = ""
    failing_since: float = 0.0     # Unix time since which reads fail (0: the latest read answered)
    error: str = ""                # the latest failed read's error


class StoreRecord:
    """This worker's record in the artifact store (GetCalibration for its checkpoint and profile), read once at start
    and then by a thread every `period_s`. `token` gives the bearer token to show (any tenant may read records; it
    is called on every read, so a rotated token is followed). The state is replaced whole, so a reader on another
    thread sees one read's record and problem together."""

    def __init__(self, target: str, token: Callable[[], str], key: CalibrationKey, *, tls: TlsConfig | None = None,
                 period_s: float = 30.0):
        assert period_s > 0, period_s
        self.target, self.token, self.key, self.tls, self.period_s = target, token, key.check(), tls, period_s
        self._state = _StoreRead()
        self._stop = threading.Event()
        self.poll()
        self._thread = threading.Thread(target=self._run, name="calibration-store", daemon=True)
        self._thread.start()

    @property
    def record(self) -> dict | None:
        return self._state.record

    def current(self) -> tuple[dict | None, str]:
        s = self._state
        return s.record, s.problem

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.poll()

    def poll(self) -> None:
        """Read the record once and put the outcome in force."""
        prev, now = self._state, time.time()
        try:
            with StoreClient(self.target, self.token(), tls=self.tls, timeout_s=STORE_TIMEOUT_S) as client:
                entry = client.get_calibration(self.key)
            record = json.loads(entry.record)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except NotFound:
            state = _StoreRead(None, f"no calibration record in the store at {self.target} for this checkpoint and "
                                     f"profile ({self.key.profile})", read_at=now)
        except (DataLoss, ValueError) as e:              # the store answered, with nothing usable: closed
            state = _StoreRead(None, f"the calibration record in the store at {self.target} cannot be used: {e}",
                               read_at=now)
        except StoreError as e:                          # unreachable, or refusing this worker: keep what we had
            state = dataclasses.replace(prev, failing_since=prev.failing_since or now,
                                        error=f"{type(e).__name__}: {e}"[:500])
            if not prev.failing_since:
                log.warning("calibration: the store at %s could not be read (%s); %s", self.target, state.error,
                            "the record read before stays in force" if prev.read_at else "no record read yet")
        else:
            state = _StoreRead(record, "", now, entry.stored_at_unix_ms, entry.stored_by, entry.digest)
            if state.digest != prev.digest:
                log.info("calibration record read from the store at %s: stored by %s at %s (passed: %s)",
                         self.target, state.stored_by, _when(state.stored_at_unix_ms / 1000), record.get("passed"))
        if state.problem and state.problem != prev.problem:
            log.warning("calibration: %s", state.problem)
        self._state = state

    def unreachable(self) -> str | None:
        """None while the latest read answered; else since when reads fail, why, and what stays in force."""
        s = self._state
        if not s.failing_since:
            return None
        kept = (f"the record read at {_when(s.read_at)} stays in force" if s.record is not None else
                f"the answer read at {_when(s.read_at)} stays in force" if s.read_at else "no record was read yet")
        return f"the store at {self.target} could not be read since {_when(s.failing_since)}; {kept} ({s.error})"

    def describe(self) -> dict:
        s = self._state
        return {"source": "store", "store": {
            "target": self.target, "profile_id": self.key.profile, "period_s": self.period_s,
            "read_at": _when(s.read_at) if s.read_at else None,
            "stored_at": _when(s.stored_at_unix_ms / 1000) if s.stored_at_unix_ms else None,
            "stored_by": s.stored_by or None, "digest": s.digest or None, "unreachable": self.unreachable()}}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=STORE_TIMEOUT_S + 5)


class CalibrationGate:
    def __init__(self, source: RecordFile | StoreRecord | str | None, fingerprint: str, profile: ReuseProfile):
        """`source`: where the record comes from; a path is a RecordFile; "" or None: no record required."""
        if isinstance(source, str):
            source = RecordFile(source) if source else None
        self.source, self.fingerprint, self.profile = source, fingerprint, profile

    @property
    def required(self) -> bool:
        return self.source is not None

    @property
    def record(self) -> dict | None:
        return self.source.record if self.source is not None else None

    def _verdict(self) -> tuple[dict | None, str | None]:
        if self.source is None:
            return None, None
        record, problem = self.source.current()
        if record is None:
            return None, problem or "no calibration record"
        ok, why = check_record(record, self.fingerprint, self.profile)
        return record, None if ok else why

    def reason(self) -> str | None:
        """None when the reuse arm may run; else why not (the detail of an `uncalibrated` fallback)."""
        return self._verdict()[1]

    def agreement_lower_bound(self) -> float:
        """The lower end of the 95% interval of teacher-forced top-1 agreement in the record in force (the bound the
        shadow-agreement alert holds live traffic to: `redknot_calibration_agreement_lower_bound`); NaN when no
        record is in force (none required, none there, or one that does not pass for this checkpoint and profile)."""
        record, why = self._verdict()
        if record is None or why is not None:
            return math.nan
        try:
            return float(record["metrics"]["tf_top1"]["ci"][0])
        except (KeyError, IndexError, TypeError, ValueError):
            return math.nan

    def describe(self) -> dict:
        """What the worker's /calibration shows: whether a record is required and where it comes from, the record
        in force, the verdict, and the agreement bound the worker exports (null: none)."""
        record, why = self._verdict()
        bound = self.agreement_lower_bound()
        out = {"required": self.required, "source": None, "path": None, "store": None, "record": record,
               "serves_reuse": why is None, "reason": why,
               "agreement_lower_bound": None if math.isnan(bound) else bound}
        if self.source is not None:
            out.update(self.source.describe())
        return out

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
