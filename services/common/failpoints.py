"""Testing only: named points where a process pauses, so a test can kill it at a known step of a job.
Spec: `name=seconds,...` (a bare name pauses for an hour)."""
from __future__ import annotations

import sys
import time


class Failpoints:
    def __init__(self, spec: str = ""):
        self.points: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, _, secs = item.partition("=")
            self.points[name.strip()] = float(secs) if secs else 3600.0

    def hit(self, name: str) -> None:
        if name in self.points:
            print(f"FAILPOINT {name} reached", file=sys.stderr, flush=True)
            time.sleep(self.points[name])
