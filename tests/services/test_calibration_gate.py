"""The worker's calibration gate (issue 31 item 5): open when no record is required; with a record file, open only
while the file holds a passing record of this checkpoint and profile; a changed file takes effect without a
restart; an unreadable one closes the gate and says why. With the record in a real artifact store: the gate follows
what an admin puts there for its own checkpoint and profile, no record closes it, a store that goes away keeps the
record last read (and says so), and the worker's gauge carries the record's agreement bound."""
import json
import math
import os
import time

import pytest
from prometheus_client import generate_latest

import services.worker.calibration as calibration
from runtime.eval.calibrate import RECORD_VERSION
from runtime.reuse.profile import load_profile
from services.store.calibration import CalibrationKey
from services.store.keys import digest_bytes, profile_id
from services.worker.calibration import CalibrationGate, StoreRecord
from services.worker.metrics import WorkerMetrics
from services.worker.settings import WorkerSettings

from .conftest import TOKENS, free_port

PROF = load_profile("demo")
FP = digest_bytes(b"the served checkpoint")
ADMIN = {"REDKNOT_STORE_ADMIN_TENANTS": "acme"}


def record(passed=True, fingerprint="fp", profile=PROF, low=None):
    rec = {"version": RECORD_VERSION, "fingerprint": fingerprint, "profile": profile.to_dict(), "passed": passed,
           "checks": {"tf_top1": {"ok": passed}, "f1_delta": {"ok": True}}}
    if low is not None:
        rec["metrics"] = {"tf_top1": {"value": low + 0.02, "ci": [low, low + 0.04]}}
    return rec


def write(path, obj):
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))      # a new stamp even within one tick


def test_the_gate_follows_its_record_file(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "WATCH_S", 0.0)
    assert CalibrationGate("", "fp", PROF).reason() is None                  # nothing required: open
    assert CalibrationGate("", "fp", PROF).describe()["required"] is False
    f = tmp_path / "calibration.json"
    gate = CalibrationGate(str(f), "fp", PROF)
    assert "No such file" in gate.reason() and not gate.describe()["serves_reuse"]
    write(f, record(passed=False))
    assert gate.reason() == "the calibration record did not pass: tf_top1"
    write(f, record())
    assert gate.reason() is None and gate.describe()["serves_reuse"] and gate.describe()["record"]["passed"]
    write(f, record(fingerprint="another"))
    assert gate.reason() == "the calibration record is for another checkpoint"
    write(f, record(profile=PROF.replace(budget=0.1)))
    assert gate.reason() == "the calibration record is for another profile"
    write(f, "{not json")
    assert "cannot be read" in gate.reason() and gate.record is None
    write(f, "[1, 2]")
    assert "not a JSON object" in gate.reason()
    write(f, record())
    assert gate.reason() is None
    assert math.isnan(gate.agreement_lower_bound())             # a passing record without metrics: no bound
    write(f, record(low=0.93))
    assert gate.agreement_lower_bound() == 0.93 and gate.describe()["agreement_lower_bound"] == 0.93
    write(f, record(passed=False, low=0.93))                     # not in force: no bound
    assert math.isnan(gate.agreement_lower_bound()) and gate.describe()["agreement_lower_bound"] is None


@pytest.mark.parametrize("watch", [60.0])
def test_the_file_is_looked_at_once_per_watch_period(tmp_path, monkeypatch, watch):
    monkeypatch.setattr(calibration, "WATCH_S", watch)
    f = tmp_path / "calibration.json"
    write(f, record())
    gate = CalibrationGate(str(f), "fp", PROF)
    assert gate.reason() is None
    write(f, record(passed=False))
    assert gate.reason() is None                 # within the period the record in force stays (no stat per request)


# ------------------------------------------------------------------------------------- the record in the store

def put(store, rec: dict) -> None:
    with store.client("acme") as c:
        c.put_calibration(json.dumps(rec).encode())


def until(what, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, f"not reached in {timeout} s"
        time.sleep(0.02)
    return got


def exported_bound(metrics: WorkerMetrics) -> str:
    (line,) = [ln for ln in generate_latest(metrics.registry).decode().splitlines()
               if ln.startswith("redknot_calibration_agreement_lower_bound ")]
    return line.split()[-1]


def test_the_gate_follows_the_record_in_the_store(store_factory):
    store = store_factory(extra_env=ADMIN).start()
    key = CalibrationKey(FP, profile_id(PROF.to_dict()))
    # the worker reads with a tenant's token that is not an admin's: every tenant reads records
    gate = CalibrationGate(StoreRecord(store.target, lambda: TOKENS["globex"], key, period_s=0.05), FP, PROF)
    metrics = WorkerMetrics()
    metrics.calibration_bound.set_function(gate.agreement_lower_bound)
    try:
        # nothing stored for this checkpoint and profile: closed, and it says so
        assert "no calibration record in the store" in gate.reason()
        d = gate.describe()
        assert d["required"] and d["source"] == "store" and d["store"]["target"] == store.target
        assert d["agreement_lower_bound"] is None and exported_bound(metrics) == "NaN"
        put(store, record(passed=False, fingerprint=FP, low=0.80))
        assert until(lambda: gate.reason() == "the calibration record did not pass: tf_top1")
        assert exported_bound(metrics) == "NaN"                    # a failing record is not in force
        put(store, record(fingerprint=FP, profile=PROF.replace(budget=0.1), low=0.99))   # another profile's
        put(store, record(fingerprint=digest_bytes(b"another checkpoint"), low=0.99))    # another checkpoint's
        time.sleep(0.3)
        assert gate.reason() == "the calibration record did not pass: tf_top1"          # neither is this worker's
        # a passing record takes effect without a restart; its bound is exported
        put(store, record(fingerprint=FP, low=0.91))
        assert until(lambda: gate.reason() is None)
        assert gate.agreement_lower_bound() == 0.91 and float(exported_bound(metrics)) == 0.91
        d = gate.describe()
        assert d["serves_reuse"] and d["store"]["stored_by"] == "acme" and d["store"]["unreachable"] is None
        # the store goes away: the record last read stays in force, and describe() says the store is unreachable
        store.kill()
        unreachable = until(lambda: gate.describe()["store"]["unreachable"])
        assert "could not be read since" in unreachable and "stays in force" in unreachable
        assert gate.reason() is None and gate.agreement_lower_bound() == 0.91
        # back (same index): read again, and a new failing record closes the gate
        back = store_factory(extra_env=ADMIN).start(port=store.port)
        assert until(lambda: gate.describe()["store"]["unreachable"] is None)
        put(back, record(passed=False, fingerprint=FP, low=0.91))
        assert until(lambda: gate.reason() == "the calibration record did not pass: tf_top1")
        assert exported_bound(metrics) == "NaN"
    finally:
        gate.close()


def test_a_store_not_reached_at_start_closes_the_gate():
    key = CalibrationKey(FP, profile_id(PROF.to_dict()))
    gate = CalibrationGate(StoreRecord(f"127.0.0.1:{free_port()}", lambda: TOKENS["acme"], key, period_s=60), FP,
                           PROF)
    try:
        assert gate.reason() == "no calibration record read from the store yet" and gate.record is None
        assert "no record was read yet" in gate.describe()["store"]["unreachable"]
        assert math.isnan(gate.agreement_lower_bound())
    finally:
        gate.close()


def test_one_source_of_the_record():
    assert WorkerSettings.from_args(env={"REDKNOT_WORKER_CALIBRATION_STORE": "true"}).calibration_store
    with pytest.raises(ValueError, match="choose one"):
        WorkerSettings.from_args(env={"REDKNOT_WORKER_CALIBRATION_STORE": "true",
                                      "REDKNOT_WORKER_CALIBRATION_RECORD": "/etc/calibration.json"})
    with pytest.raises(ValueError, match="not positive"):
        WorkerSettings(calibration_poll_s=0)
