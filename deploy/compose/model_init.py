"""docker-compose's `model-init`: make sure REDKNOT_MODEL holds a checkpoint before the API, the builder and the
worker start. The default path gets the small random demo checkpoint (written once into the `models` volume);
any other path must already hold one (a real checkpoint mounted through REDKNOT_MODELS)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

DEMO = Path("/models/demo/checkpoint")


def main() -> int:
    model = Path(os.environ.get("REDKNOT_MODEL", str(DEMO)))
    if (model / "config.json").exists():
        print(f"model-init: {model} holds a checkpoint")
        return 0
    if model != DEMO:
        print(f"model-init: no checkpoint at {model}: mount its directory with REDKNOT_MODELS=/host/dir and set "
              f"REDKNOT_MODEL=/models/<name>", file=sys.stderr)
        return 1
    from rich.console import Console

    from runtime.demo import ensure_checkpoint
    ensure_checkpoint(DEMO.parent, Console())
    print(f"model-init: wrote the demo checkpoint to {DEMO}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
