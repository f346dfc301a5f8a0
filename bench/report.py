"""The benchmarks' one output helper. A script prints one machine line first (`header`) and, with `--json`, writes
one record last (`write_json`): the machine (device, torch, Triton, the commit measured), the script's arguments and
its own fields. Raw outputs that docs/BENCHMARKS.md cites live under bench/results/."""
from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def _commit() -> str | None:
    """`git describe --always --dirty` of the tree measured; None where the tree is a copy without .git (the device
    machine's), so the record says nothing rather than something wrong."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def machine(device: torch.device | str | None = None) -> dict:
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__,
                triton=triton_version, commit=_commit())


def header(what: str = "", device: torch.device | str | None = None) -> dict:
    """Print the machine line (`# device | torch | triton | commit | what`) and return the machine."""
    m = machine(device)
    parts = [m["device"], f"torch {m['torch']}"] + ([f"triton {m['triton']}"] if m["triton"] else []) + \
        ([m["commit"]] if m["commit"] else []) + ([what] if what else [])
    print("# " + " | ".join(parts), flush=True)
    return m


def write_json(path: str | Path | None, record: dict, args=None, device: torch.device | str | None = None,
               quiet: bool = False) -> None:
    """Write `record` to `path` (nothing without a path) beside the machine and the arguments; the record's own
    fields win where a name is shared (a script may name its device more exactly). `quiet`: no line printed (a
    partial record rewritten as a run goes)."""
    if not path:
        return
    out = dict(machine(device))
    if args is not None:
        out["args"] = vars(args)
    out.update(record)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1, default=str) + "\n")
    if not quiet:
        print(f"# wrote {path}", flush=True)
