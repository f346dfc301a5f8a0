"""The commands and environment that the Helm chart and docker-compose.yml give each container are ones the
services accept: every command line is parsed by the real `redknot` CLI, every REDKNOT_* variable is a setting
of that service, and the resulting settings point at the ports, volumes and Services the deployment defines.
Each service's entry point is replaced by a stub that only records the settings it was started with."""
from __future__ import annotations

import dataclasses
import importlib
import re
import urllib.parse
from pathlib import PurePosixPath

import pytest

from .conftest import VALUES_FILES, chart_values, objects, render, values
from .test_containers import _compose_config

ENTRY_POINTS = {"store": "services.store.server", "api": "services.api.server",
                "builder": "services.builder.server", "worker": "services.worker.server"}
IMAGE_ONLY_ENV = {"REDKNOT_HEALTHCHECK", "REDKNOT_HEALTHCHECK_TIMEOUT_S"}     # read by deploy/healthcheck.py


def _env_names(settings_cls) -> set[str]:
    if dataclasses.is_dataclass(settings_cls):
        return {f.metadata["env"] for f in dataclasses.fields(settings_cls)}
    return {f.json_schema_extra["env"] for f in settings_cls.model_fields.values()}


def available(service: str) -> bool:
    """Whether this tree has the service's code (the chart and compose describe all four regardless)."""
    try:
        importlib.import_module(ENTRY_POINTS[service])
        return True
    except ModuleNotFoundError:
        return False


def start_settings(monkeypatch, argv: list[str], env: dict[str, str]):
    """(service, settings) that `redknot <argv>` would start with under `env`, without starting anything."""
    from services import cli
    started = []
    for service, module in ENTRY_POINTS.items():
        if available(service):
            monkeypatch.setattr(importlib.import_module(module), "main",
                                lambda s, _svc=service: started.append((_svc, s)) or 0)
    for key in [k for k in __import__("os").environ if k.startswith("REDKNOT_") or k == "REDIS_URL"]:
        monkeypatch.delenv(key)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(argv) == 0
    (got,) = started
    return got


def _check_env_names(where: str, service: str, settings, env: dict[str, str]) -> None:
    known = _env_names(type(settings)) | IMAGE_ONLY_ENV
    unknown = {k for k in env if (k.startswith("REDKNOT_") or k == "REDIS_URL") and k not in known}
    assert not unknown, f"{where}: {service} has no setting read from {sorted(unknown)}"


def _port(listen: str) -> int:
    return int(listen.rpartition(":")[2])


def _under(path: str, mounts: set[str]) -> bool:
    return any(PurePosixPath(path).is_relative_to(m) for m in mounts)


# ------------------------------------------------------------------------------------------------- Helm
def _container_env(c: dict) -> dict[str, str]:
    """The container's environment as Kubernetes makes it: secrets stand in as placeholders, a container's resource
    (the downward API) as a count, and $(NAME) of a variable defined earlier in the list is expanded (REDIS_URL
    carries the bundled Redis's REDIS_PASSWORD)."""
    out = {}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m.group(1), m.group(0)), e["value"])
        elif e["name"] == "REDIS_URL":                     # from a Secret at run time
            out[e["name"]] = "redis://redis-from-secret:6379/0"
        elif "resourceFieldRef" in e.get("valueFrom", {}):     # the downward API: a whole count of CPUs
            out[e["name"]] = "6"
        else:
            out[e["name"]] = "from-a-secret"
    return out


@pytest.mark.parametrize("name", VALUES_FILES)
def test_helm_commands_and_env_start_the_services(name, rendered, monkeypatch):
    objs = objects(rendered[name])
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    seen = set()
    for w in (o for o in objs if o["kind"] in ("Deployment", "StatefulSet")):
        component = w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        if component == "redis" or not available(component):
            continue
        (c,) = w["spec"]["template"]["spec"]["containers"]
        env = _container_env(c)
        service, s = start_settings(monkeypatch, c["command"][1:] + c.get("args", []), env)
        assert service == component, (service, component)
        seen.add(service)
        where = f"{name} values, {w['metadata']['name']}"
        _check_env_names(where, service, s, env)
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
        if service == "store":
            assert _port(s.listen) == ports["grpc"] and _port(s.metrics_listen) == ports["metrics"], where
            assert _under(s.tokens_file, mounts) and _under(s.blob_root, mounts), where
            sv = chart_values(values(name))["store"]
            assert (s.gc_interval_s, s.upload_ttl_s, s.stream_idle_s, s.stream_deadline_s, s.redis_connections) == (
                sv["gcIntervalSeconds"], sv["uploadTtlSeconds"], sv["streamIdleSeconds"],
                sv["streamDeadlineSeconds"], sv["redisConnections"]), where
            continue
        assert _under(s.tokens_file, mounts), where
        if values(name)["model"].get("volume"):
            assert _under(s.model, mounts), where
        host, _, port = s.store.rpartition(":")
        store_svc = services[host]
        assert store_svc["metadata"]["labels"]["app.kubernetes.io/component"] == "store", where
        assert int(port) in {p["port"] for p in store_svc["spec"]["ports"] if p["name"] == "grpc"}, where
        if values(name).get("redis", {}).get("enabled", True):
            url = urllib.parse.urlsplit(s.redis_url)
            assert url.hostname in services, where
            if values(name).get("redis", {}).get("auth", {}).get("enabled", True):
                assert url.password == "from-a-secret", where       # $(REDIS_PASSWORD), from the Secret
        assert s.tp == values(name).get("worker", {}).get("tp", 8)
        if service in ("worker", "builder"):
            assert s.cpus == 6, where                      # the pod's CPU share, for the ranks' threads
        if service == "api":
            assert _port(s.listen) == ports["http"], where
            worker_host = s.worker_url.split("//")[1].split(":")[0]
            assert services[worker_host]["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
            assert _port(s.worker_url.rstrip("/")) in {p["port"] for p in services[worker_host]["spec"]["ports"]
                                                       if p["name"] == "http"}
        elif service == "worker":
            assert _port(s.listen) == ports["http"], where
            assert s.device == ("cuda" if "nvidia.com/gpu" in c["resources"].get("limits", {}) else "cpu")
            assert s.tier_gib == values(name).get("worker", {}).get("tierGiB", 48), where
            assert s.shadow_fraction == values(name).get("worker", {}).get("shadowFraction", 0.02), where
        elif service == "builder":
            assert _port(s.metrics_listen) == ports["metrics"], where
            assert _under(s.workdir, mounts), where
    assert seen == {svc for svc in ENTRY_POINTS if available(svc)}
    if len(seen) < len(ENTRY_POINTS):
        pytest.skip(f"checked {sorted(seen)}; the code of the others is not in this tree yet")


def test_helm_services_agree_on_what_artifacts_are_bound_to(rendered, monkeypatch):
    """The API, the builder and the workers get the same model, profile, TP size, Redis prefix and store."""
    objs = objects(render({**values("gpu"), "model": {**values("gpu")["model"], "fingerprint": "f" * 64}}))
    shared = []
    for w in (o for o in objs if o["kind"] in ("Deployment", "StatefulSet")):
        (c,) = w["spec"]["template"]["spec"]["containers"]
        if c.get("command", ["", ""])[1] in ("api", "builder", "worker") and available(c["command"][1]):
            _, s = start_settings(monkeypatch, c["command"][1:] + c.get("args", []), _container_env(c))
            shared.append((s.model, s.profile, s.tp, s.redis_prefix, s.store, s.tokens_file, s.fingerprint))
    if len(shared) < 3:
        pytest.skip("the API, builder or worker code is not in this tree yet")
    assert len(set(shared)) == 1, shared
    assert shared[0][1] == "flash" and shared[0][6] == "f" * 64


# ----------------------------------------------------------------------------------------------- compose
STORE_TUNING = {"gcIntervalSeconds": ("gc_interval_s", "REDKNOT_STORE_GC_INTERVAL_S"),
                "uploadTtlSeconds": ("upload_ttl_s", "REDKNOT_STORE_UPLOAD_TTL_S"),
                "streamIdleSeconds": ("stream_idle_s", "REDKNOT_STORE_STREAM_IDLE_S"),
                "streamDeadlineSeconds": ("stream_deadline_s", "REDKNOT_STORE_STREAM_DEADLINE_S"),
                "redisConnections": ("redis_connections", "REDKNOT_STORE_REDIS_CONNECTIONS")}


def _store_tuning(s) -> dict[str, float]:
    """The store values of the chart by their chart name, from the chart's values (a dict) or store Settings."""
    if isinstance(s, dict):
        return {k: s[k] for k in STORE_TUNING}
    return {k: getattr(s, field) for k, (field, _) in STORE_TUNING.items()}


@pytest.mark.parametrize("profile", ["", "gpu"])
def test_compose_commands_and_env_start_the_services(profile, tmp_path, monkeypatch):
    cfg = _compose_config(tmp_path, *([profile] if profile else []))
    services = cfg["services"]
    for name, svc in services.items():
        cmd = svc.get("command") or []
        if not cmd or cmd[0] != "redknot" or not available(name.removesuffix("-gpu")):
            continue
        env = {k: str(v) for k, v in svc.get("environment", {}).items()}
        service, s = start_settings(monkeypatch, cmd[1:], env)
        assert name.removesuffix("-gpu") == service
        _check_env_names(f"compose {name}", service, s, env)
        mounts = {v["target"] for v in svc.get("volumes", [])} | {"/tmp", "/dev/shm"} | \
                 {x["target"] for x in svc.get("secrets", [])}
        assert _under(s.tokens_file, mounts), name
        if service == "store":
            assert _under(s.blob_root, mounts)
            assert _store_tuning(s) == _store_tuning(chart_values({})["store"]) == _store_tuning(type(s)()), name
            continue
        assert _under(s.model, mounts), name
        assert s.store.split(":")[0] in services and s.redis_url.split("//")[1].split(":")[0] in services
        if service == "api":
            assert s.worker_url == "http://worker:8100"
        if service == "builder":
            assert _under(s.workdir, mounts)


def test_compose_store_tuning_follows_the_environment(tmp_path, monkeypatch):
    """The chart's store values are compose variables of the same env names: set in the shell, they reach the
    store's settings."""
    want = {"gcIntervalSeconds": 30, "uploadTtlSeconds": 120, "streamIdleSeconds": 5, "streamDeadlineSeconds": 600,
            "redisConnections": 8}
    env = {STORE_TUNING[k][1]: str(v) for k, v in want.items()}
    svc = _compose_config(tmp_path, extra_env=env)["services"]["store"]
    assert {k: str(svc["environment"][v]) for k, (_, v) in STORE_TUNING.items()} == \
        {k: str(v) for k, v in want.items()}
    if not available("store"):
        pytest.skip("the store's code is not in this tree")
    _, s = start_settings(monkeypatch, svc["command"][1:], {k: str(v) for k, v in svc["environment"].items()})
    assert _store_tuning(s) == want
