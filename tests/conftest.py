import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# one compute thread per core: under xdist the test processes share the cores (2 workers on 2 cores: one thread
# each; two each measured 4-10x slower per test, the workers' spinning threads taking each other's cores)
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))

# Without a GPU the Triton kernels run under Triton's interpreter (tests/kernels/test_interpret.py): the switch must
# be set before any kernel module is imported, since @triton.jit picks the interpreter at decoration time
# (runtime/kernels/_triton.py then fits the interpreter to numpy >= 2.3).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_terminal_summary(terminalreporter):
    """The fault suite's summary. The drill's table (tests/services/test_faults.py): each test there records its row
    with `record_property("fault", (phase, process killed))` and then `record_property("fault_outcome", text)`; the
    counts: tests record `("fault_counts", (suite, {count: n}))` (bad HTTP and gRPC inputs, the drill's documents),
    summed per suite. Read from the reports, so it shows with or without -s, and under xdist (user properties travel
    with the reports)."""
    rows, counts, seen = [], {}, set()
    for reports in terminalreporter.stats.values():
        for rep in reports:
            props = getattr(rep, "user_properties", ())
            if getattr(rep, "when", None) == "call":
                d = dict(props)
                if "fault" in d:
                    rows.append((*d["fault"], d.get("fault_outcome", "-"), rep.outcome))
            for i, (name, value) in enumerate(props):     # once per test, from whichever report carries it
                if name == "fault_counts" and (rep.nodeid, i) not in seen:
                    seen.add((rep.nodeid, i))
                    suite, n = value
                    for k, v in n.items():
                        counts.setdefault(suite, {}).setdefault(k, 0)
                        counts[suite][k] += v
    if counts:
        terminalreporter.write_sep("=", "fault suite")
        for suite, n in counts.items():
            terminalreporter.write_line(f"{suite}: " + ", ".join(f"{v} {k}" for k, v in n.items()))
    if not rows:
        return
    head = ("phase", "killed", "outcome", "result")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    terminalreporter.write_sep("=", "fault drill")
    for r in [head, *rows]:
        terminalreporter.write_line("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
