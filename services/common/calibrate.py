"""`redknot calibrate`: the quality harness on a deployment's checkpoint and data for a profile, then a calibration
record bound to the checkpoint's fingerprint (the one the workers and builders compute) and to the profile
(`runtime/eval/calibrate.py`), written as JSON and, with `--store`, stored in the artifact store for the whole
deployment (PutCalibration, with an admin tenant's token), where workers reading records from the store find it.
Exit 0: the record passed its thresholds; 4: it did not (the record is written, and stored, either way, with each
check: a failed calibration closes the gate); 5: the record is written but the store refused it or could not be
reached; 2 or 3: no record (bad arguments, or the run did not finish)."""
from __future__ import annotations

import itertools
import json
from pathlib import Path


def _store_token(args) -> str | None:
    """The admin token for --store, read before the harness runs so a bad flag costs nothing; None: refused."""
    if not args.store:
        return ""
    if not args.store_token_file:
        print("redknot calibrate: --store needs --store-token-file (an admin tenant's token)")
        return None
    try:
        token = Path(args.store_token_file).read_text().strip()
        if args.store_tls_ca:
            Path(args.store_tls_ca).read_bytes()
    except OSError as err:
        print(f"redknot calibrate: {err.filename}: {err.strerror}")
        return None
    if not token or len(token.split()) != 1:
        print(f"redknot calibrate: {args.store_token_file} must hold one bearer token")
        return None
    return token


def _upload(args, token: str, raw: bytes) -> int:
    from services.store.client import StoreClient, TlsConfig
    from services.store.errors import StoreError
    tls = TlsConfig(Path(args.store_tls_ca).read_bytes()) if args.store_tls_ca else None
    try:
        with StoreClient(args.store, token, tls=tls, timeout_s=30.0) as client:
            stored = client.put_calibration(raw)
    except StoreError as err:
        print(f"redknot calibrate: the record is written to {args.record} but the store at {args.store} did not take "
              f"it: {type(err).__name__}: {err}")
        return 5
    print(f"record stored in the artifact store at {args.store} for checkpoint "
          f"{stored.key.checkpoint_fingerprint[:12]}... and profile {stored.key.profile}"
          f"{' (it replaced the one stored before)' if stored.replaced else ''}")
    return 0


def run_calibrate(args) -> int:
    from runtime.eval.calibrate import CalibrationError, Thresholds, data_digest, make_record
    from runtime.eval.cli import evaluate
    from runtime.eval.data import load_task
    from runtime.reuse.profile import load_profile
    from services.common.serving import checkpoint_identity

    if not args.profile:
        print("redknot calibrate: name the profile to calibrate (--profile: a preset or a JSON object)")
        return 2
    try:
        profile = load_profile(args.profile)
    except (ValueError, TypeError) as err:
        print(f"redknot calibrate: {err}")
        return 2
    token = _store_token(args)
    if token is None:
        return 2
    if args.model is None:
        from runtime.llama.gguf import convert_gguf
        args.model = str(convert_gguf().out)
    summary, status = evaluate(args)
    if summary is None or status != 0:
        return status or 3
    examples = itertools.islice(load_task(args.task, args.data, None), args.offset, args.offset + args.limit)
    try:
        record = make_record(summary, fingerprint=checkpoint_identity(args.model).fingerprint, profile=profile,
                             task=args.task, digest=data_digest(examples),
                             thresholds=Thresholds(args.min_tf_top1, args.min_f1_delta, args.max_tf_kl))
    except CalibrationError as err:
        print(f"redknot calibrate: {err}")
        return 2
    raw = (json.dumps(record, indent=1) + "\n").encode()
    Path(args.record).write_bytes(raw)
    verdict = "passed" if record["passed"] else "did not pass"
    checks = ", ".join(f"{k} {c['value']:.3f} [{c['ci'][0]:.3f}, {c['ci'][1]:.3f}] "
                       f"{'>=' if c['side'] == 'low' else '<='} {c['bound']}: {'ok' if c['ok'] else 'FAILED'}"
                       for k, c in record["checks"].items())
    print(f"calibration of profile {profile.name!r} on {record['n']} {args.task} questions {verdict} ({checks}); "
          f"record written to {args.record}")
    if args.store and _upload(args, token, raw):
        return 5
    return 0 if record["passed"] else 4
