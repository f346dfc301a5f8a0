"""`redknot calibrate` (issue 31 item 5): the harness on a checkpoint, data and profile writes a record bound to the
checkpoint fingerprint the services compute and to the profile, with the served arm's metrics and CIs, the
thresholds, each check and the verdict; `check_record` accepts only a passed record of that checkpoint and profile;
with `--store` the same bytes are stored in a real artifact store for the deployment, with an admin's token."""
import json
import uuid

import pytest

from runtime.eval.calibrate import CalibrationError, check_record, make_record, served_arm
from runtime.model.checkpoint import build_demo_tokenizer
from runtime.model.config import demo
from runtime.model.random_init import write_random_checkpoint
from runtime.reuse.profile import load_profile
from services.cli import main as redknot
from services.common.serving import checkpoint_identity
from services.store.calibration import CalibrationKey
from services.store.errors import NotFound
from services.store.keys import profile_id
from tests.services.conftest import TOKENS, StoreProcess, _cleanup_prefix, redis_url  # noqa: F401 - the store's Redis


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("calib")
    tok = d / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    build_demo_tokenizer(512, tok)
    return write_random_checkpoint(d / "ckpt", demo(512), seed=0, device="cpu", tokenizer_json=tok)


def calibrate(checkpoint, record, *extra) -> int:
    return redknot(["calibrate", "--task", "kv_retrieval", "--model", str(checkpoint), "--limit", "2", "--budgets",
                    "0.25", "--max-new-tokens", "2", "--teacher-tokens", "2", "--device", "cpu", "--record",
                    str(record), *extra])


def test_a_record_is_bound_to_the_checkpoint_and_profile_and_says_why_it_passed_or_not(checkpoint, tmp_path):
    strict, lenient = tmp_path / "strict.json", tmp_path / "lenient.json"
    assert calibrate(checkpoint, strict) == 2 and not strict.exists()          # no profile named: nothing runs
    # a random checkpoint does not reach the default bar: the record is written, failed, with its checks
    assert calibrate(checkpoint, strict, "--profile", "demo", "--out", str(tmp_path / "run.json")) == 4
    rec = json.loads(strict.read_text())
    demo_prof = load_profile("demo")
    fp = checkpoint_identity(checkpoint).fingerprint
    assert rec["fingerprint"] == fp and rec["profile"] == demo_prof.to_dict() and rec["family"] == "deepseek_v4"
    assert rec["arm"] == served_arm(demo_prof) == "reuse@25%" and rec["n"] == 2 and len(rec["data_digest"]) == 64
    assert not rec["passed"] and not rec["checks"]["tf_top1"]["ok"]
    run = json.loads((tmp_path / "run.json").read_text())["arms"]["reuse@25%"]
    assert rec["checks"]["tf_top1"]["ci"] == run["ci"]["tf_top1"] and rec["metrics"]["tf_kl"]["value"] == run["tf_kl"]
    assert check_record(rec, fp, demo_prof) == (False, "the calibration record did not pass: tf_top1")
    # held to bounds it meets, the same run passes
    assert calibrate(checkpoint, lenient, "--profile", "demo", "--min-tf-top1", "0", "--min-f1-delta", "-1") == 0
    ok = json.loads(lenient.read_text())
    assert ok["passed"] and ok["data_digest"] == rec["data_digest"] and ok["thresholds"]["tf_top1"] == 0
    assert check_record(ok, fp, demo_prof) == (True, "")
    # bound to this checkpoint and this profile, and to the record format
    assert check_record(ok, "another", demo_prof)[1] == "the calibration record is for another checkpoint"
    assert check_record(ok, fp, demo_prof.replace(budget=0.1))[1] == "the calibration record is for another profile"
    assert not check_record(dict(ok, version=0), fp, demo_prof)[0]
    assert check_record(None, fp, demo_prof) == (False, "no calibration record for this checkpoint and profile")


def test_a_summary_that_cannot_make_a_record_is_refused(checkpoint, tmp_path):
    assert calibrate(checkpoint, tmp_path / "r.json", "--profile", "demo", "--budgets", "0.1",
                     "--min-tf-top1", "0") == 2                  # the profile's own budget (25%) was not run
    assert not (tmp_path / "r.json").exists()
    prof = load_profile("demo")
    summary = {"n": 1, "profile": dict(prof.to_dict(), name=prof.name, select=prof.select, family="llama"),
               "arms": {"reuse@25%": {"tf_top1": 1.0}}}
    with pytest.raises(CalibrationError, match="at least 2"):
        make_record(summary, fingerprint="f", profile=prof, task="t", digest="d")
    with pytest.raises(CalibrationError, match="another profile"):
        make_record(summary, fingerprint="f", profile=prof.replace(budget=0.5), task="t", digest="d")


def test_calibrate_stores_the_record_in_the_artifact_store_with_an_admin_token(checkpoint, tmp_path, redis_url):
    prefix = f"rkcal-{uuid.uuid4().hex[:8]}"
    store = StoreProcess(tmp_path, redis_url, prefix, extra_env={"REDKNOT_STORE_ADMIN_TENANTS": "acme"}).start()
    admin, tenant = tmp_path / "admin.token", tmp_path / "tenant.token"
    admin.write_text(TOKENS["acme"] + "\n")
    tenant.write_text(TOKENS["globex"])
    rec = tmp_path / "calibration.json"
    key = CalibrationKey(checkpoint_identity(checkpoint).fingerprint, profile_id(load_profile("demo").to_dict()))
    lenient = ("--profile", "demo", "--min-tf-top1", "0", "--min-f1-delta", "-1", "--store", store.target)
    try:
        # refused before the harness runs: --store without a token, or a token file that is not there
        assert calibrate(checkpoint, rec, *lenient) == 2 and not rec.exists()
        assert calibrate(checkpoint, rec, *lenient, "--store-token-file", str(tmp_path / "none")) == 2
        # a tenant that is not an admin: the record is written, the store refuses it (exit 5), nothing is stored
        assert calibrate(checkpoint, rec, *lenient, "--store-token-file", str(tenant)) == 5
        assert json.loads(rec.read_text())["passed"]
        with store.client("globex") as c, pytest.raises(NotFound):
            c.get_calibration(key)
        # an admin: stored, the very bytes of the file, under the checkpoint's fingerprint and the profile's id
        rec.unlink()
        assert calibrate(checkpoint, rec, *lenient, "--store-token-file", str(admin)) == 0
        with store.client("globex") as c:
            got = c.get_calibration(key)
        assert got.record == rec.read_bytes() and got.stored_by == "acme"
    finally:
        store.kill()
        _cleanup_prefix(redis_url, prefix)
