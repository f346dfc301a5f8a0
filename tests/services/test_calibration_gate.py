"""The worker's calibration gate (issue 31 item 5): open when no record is required; with a record file, open only
while the file holds a passing record of this checkpoint and profile; a changed file takes effect without a
restart; an unreadable one closes the gate and says why."""
import json
import os

import pytest

import services.worker.calibration as calibration
from runtime.eval.calibrate import RECORD_VERSION
from runtime.reuse.profile import load_profile
from services.worker.calibration import CalibrationGate

PROF = load_profile("demo")


def record(passed=True, fingerprint="fp", profile=PROF):
    return {"version": RECORD_VERSION, "fingerprint": fingerprint, "profile": profile.to_dict(), "passed": passed,
            "checks": {"tf_top1": {"ok": passed}, "f1_delta": {"ok": True}}}


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


@pytest.mark.parametrize("watch", [60.0])
def test_the_file_is_looked_at_once_per_watch_period(tmp_path, monkeypatch, watch):
    monkeypatch.setattr(calibration, "WATCH_S", watch)
    f = tmp_path / "calibration.json"
    write(f, record())
    gate = CalibrationGate(str(f), "fp", PROF)
    assert gate.reason() is None
    write(f, record(passed=False))
    assert gate.reason() is None                 # within the period the record in force stays (no stat per request)
