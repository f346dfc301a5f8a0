"""Calibration records (`redknot calibrate`): the quality harness's verdict on one (checkpoint, profile), bound to
both, that a deployment keeps before it serves the reuse arm for that pair.

A record holds the served profile's own arm (`reuse@B%` at the profile's budget, its rule and knobs) measured
against the recompute arm on the deployment's data: every near-tie-robust metric with its bootstrap 95% CI, the
F1 delta's paired CI, the thresholds it was held to, each check, `passed`, the checkpoint fingerprint, the profile,
the task, the number of questions, a digest of the questions and the date. `check_record` says whether a record
lets the reuse arm be served for a given (fingerprint, profile)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import datetime, timezone

import blake3

from runtime.reuse.profile import ReuseProfile
from .harness import profile_summary

RECORD_VERSION = 1


class CalibrationError(ValueError):
    """A summary a record cannot be made from (the served arm missing, too few questions for intervals)."""


@dataclass(frozen=True)
class Thresholds:
    """What the served arm must reach, each on the side of its 95% interval that counts against it."""
    tf_top1: float = 0.95           # teacher-forced top-1 agreement with the recompute arm: CI lower bound >= this
    f1_delta: float = -0.02         # F1 against gold, reuse - recompute (paired): CI lower bound >= this
    tf_kl: float | None = None      # teacher-forced KL(recompute || reuse) per token: CI upper bound <= this


def served_arm(profile: ReuseProfile) -> str:
    """The harness's name of the arm that runs `profile` as it is (its budget, no knob changed)."""
    return f"reuse@{profile.budget * 100:g}%"


def data_digest(examples) -> str:
    """BLAKE3 over the questions as the harness reads them (ids, questions, paragraphs, gold answers)."""
    h = blake3.blake3(b"redknot.calibration-data.v1\0")
    for ex in examples:
        h.update(json.dumps(dataclasses.asdict(ex), sort_keys=True).encode() + b"\0")
    return h.hexdigest()


def make_record(summary: dict, *, fingerprint: str, profile: ReuseProfile, task: str, digest: str,
                thresholds: Thresholds = Thresholds(), date: str | None = None) -> dict:
    """The record of `summary` (a harness run whose base profile is `profile`)."""
    if summary.get("profile", {}).get("family") is None:
        raise CalibrationError("the summary names no profile: run the harness with the profile to calibrate")
    if summary["profile"] != profile_summary(profile, summary["profile"]["family"]):
        raise CalibrationError("the summary was measured under another profile than the one to calibrate")
    arm = served_arm(profile)
    r = summary["arms"].get(arm)
    if r is None:
        raise CalibrationError(f"the run has no {arm} arm (the profile's own budget): add {profile.budget} to "
                               f"--budgets")
    if "ci" not in r or "f1_delta" not in r:
        raise CalibrationError(f"{summary['n']} question(s): intervals need at least 2")
    ci = r["ci"]
    checks = {"tf_top1": dict(value=r["tf_top1"], ci=ci["tf_top1"], bound=thresholds.tf_top1, side="low",
                              ok=ci["tf_top1"][0] >= thresholds.tf_top1),
              "f1_delta": dict(value=r["f1_delta"][0], ci=r["f1_delta"][1:], bound=thresholds.f1_delta, side="low",
                               ok=r["f1_delta"][1] >= thresholds.f1_delta)}
    if thresholds.tf_kl is not None:
        checks["tf_kl"] = dict(value=r["tf_kl"], ci=ci["tf_kl"], bound=thresholds.tf_kl, side="high",
                               ok=ci["tf_kl"][1] <= thresholds.tf_kl)
    metrics = {k: dict(value=r[k], ci=ci[k]) for k in ci}
    metrics["f1_delta"] = dict(value=r["f1_delta"][0], ci=r["f1_delta"][1:])
    return dict(version=RECORD_VERSION, fingerprint=fingerprint, profile=profile.to_dict(), family=summary["profile"]
                ["family"], arm=arm, task=task, n=summary["n"], data_digest=digest,
                date=date or datetime.now(timezone.utc).isoformat(timespec="seconds"), metrics=metrics,
                thresholds=dataclasses.asdict(thresholds), checks=checks,
                passed=all(c["ok"] for c in checks.values()))


def check_record(record: dict | None, fingerprint: str, profile: ReuseProfile) -> tuple[bool, str]:
    """Whether `record` lets the reuse arm be served for (fingerprint, profile), and why not."""
    if record is None:
        return False, "no calibration record for this checkpoint and profile"
    if record.get("version") != RECORD_VERSION:
        return False, f"calibration record version {record.get('version')!r}, this server reads {RECORD_VERSION}"
    if record.get("fingerprint") != fingerprint:
        return False, "the calibration record is for another checkpoint"
    if record.get("profile") != profile.to_dict():
        return False, "the calibration record is for another profile"
    if not record.get("passed"):
        failed = [k for k, c in record.get("checks", {}).items() if not c.get("ok")]
        return False, f"the calibration record did not pass: {', '.join(failed) or 'no checks'}"
    return True, ""
