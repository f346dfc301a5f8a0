import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Without a GPU the Triton kernels run under Triton's interpreter (tests/kernels/test_interpret.py): the switch must
# be set before any kernel module is imported, since @triton.jit picks the interpreter at decoration time
# (runtime/kernels/_triton.py then fits the interpreter to numpy >= 2.3).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_terminal_summary(terminalreporter):
    """The fault drill's table (tests/services/test_faults.py): each test there records its row with
    `record_property("fault", (phase, process killed))` and then `record_property("fault_outcome", text)`. Read from
    the reports, so it shows with or without -s, and under xdist (user properties travel with the reports)."""
    rows = []
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if getattr(rep, "when", None) != "call":
                continue
            props = dict(getattr(rep, "user_properties", ()))
            if "fault" in props:
                phase, killed = props["fault"]
                rows.append((phase, killed, props.get("fault_outcome", "-"), rep.outcome))
    if not rows:
        return
    head = ("phase", "killed", "outcome", "result")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    terminalreporter.write_sep("=", "fault drill")
    for r in [head, *rows]:
        terminalreporter.write_line("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
