"""`redknot calibrate`: the quality harness on a deployment's checkpoint and data for a profile, then a calibration
record bound to the checkpoint's fingerprint (the one the workers and builders compute) and to the profile
(`runtime/eval/calibrate.py`), written as JSON. Exit 0: the record passed its thresholds; 4: it did not (the record
is written either way, with each check); 2 or 3: no record (bad arguments, or the run did not finish)."""
from __future__ import annotations

import itertools
import json
from pathlib import Path


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
    Path(args.record).write_text(json.dumps(record, indent=1) + "\n")
    verdict = "passed" if record["passed"] else "did not pass"
    checks = ", ".join(f"{k} {c['value']:.3f} [{c['ci'][0]:.3f}, {c['ci'][1]:.3f}] "
                       f"{'>=' if c['side'] == 'low' else '<='} {c['bound']}: {'ok' if c['ok'] else 'FAILED'}"
                       for k, c in record["checks"].items())
    print(f"calibration of profile {profile.name!r} on {record['n']} {args.task} questions {verdict} ({checks}); "
          f"record written to {args.record}")
    return 0 if record["passed"] else 4
