"""The Helm chart: lint, template for the default, GPU and S3 values, every manifest valid against the
Kubernetes schemas (--strict), the generated values schema current, must-set values failing with a message
that says what to set, and the wiring between objects (selectors, ports, secrets, GPU requests)."""
from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from .conftest import (CHART, NAMESPACE, RELEASE, ROOT, VALUES_FILES, chart_values, find, objects, promtool, render,
                       run, tool, values)

KUBE_VERSIONS = ("1.27.0", "1.33.0")      # the chart's kubeVersion floor and a current release
WORKLOADS = ("Deployment", "StatefulSet")


def _schema_module():
    spec = importlib.util.spec_from_file_location("values_schema", ROOT / "helm" / "values_schema.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def _container(obj: dict) -> dict:
    (c,) = _pod_spec(obj)["containers"]
    return c


def _env(container: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


# ------------------------------------------------------------------------------------------------ values
def test_values_schema_is_generated_from_documented_values():
    """values.schema.json is what helm/values_schema.py makes of values.yaml today, and generating it found a
    `# --` description for every value."""
    text = _schema_module().generate(CHART)
    assert (CHART / "values.schema.json").read_text() == text, \
        "helm/redknot/values.schema.json is stale: run `python helm/values_schema.py helm/redknot`"
    schema = json.loads(text)

    def leaves(node, path=""):
        if node.get("type") == "object" and "properties" in node:
            for k, v in node["properties"].items():
                yield from leaves(v, f"{path}.{k}".lstrip("."))
        else:
            yield path, node

    for path, node in leaves(schema):
        if path != "global":
            assert node.get("description"), f"{path} is not documented"
    assert schema["properties"]["gpuResourceName"]["default"] == "nvidia.com/gpu"
    from services.store import keys                  # tenant names: the store's own rule
    item = schema["properties"]["tenants"]["properties"]["tokens"]["items"]["properties"]
    assert item["tenant"]["pattern"] == keys._TENANT.pattern and item["token"]["minLength"] == 16


def test_schema_generator_rejects_an_undocumented_value(tmp_path):
    mod = _schema_module()
    (tmp_path / "Chart.yaml").write_text("name: x\nversion: 0.1.0\n")
    (tmp_path / "values.yaml").write_text("a:\n  # -- documented\n  b: 1\n  c: 2\n")
    with pytest.raises(mod.UndocumentedValue, match="a.c"):
        mod.generate(tmp_path)


@pytest.mark.parametrize("bad, where", [
    ({"worker": {"gpu": 8}}, "gpu"),                                   # a misspelt key
    ({"store": {"backend": "gcs"}}, "backend"),                         # not an enum value
    ({"worker": {"tp": 0}}, "tp"),                                      # below the minimum
    ({"tenants": {"tokens": [{"tenant": "acme", "token": "short"}]}}, "token"),
])
def test_schema_rejects_bad_values(bad, where):
    import helm_python as helm
    vals = {**values("default"), **bad}
    with pytest.raises(helm.HelmValuesError, match=where):
        render(vals)


@pytest.mark.parametrize("vals, message", [
    ({"tenants": {"existingSecret": "t"}}, "model.path is required"),
    ({"model": {"path": "/models/m"}}, "tenant tokens are required: set tenants.existingSecret"),
    ({"model": {"path": "/models/m"}, "tenants": {"existingSecret": "t"}, "redis": {"enabled": False}},
     "set redis.externalUrl"),
    ({**values("default"), "store": {"replicas": 2}}, "store.replicas > 1 needs store.backend=s3"),
    ({**values("default"), "store": {"backend": "s3", "replicas": 1, "localSocket": {"enabled": True}}},
     "store.localSocket.enabled needs store.backend=fs"),
    ({**values("default"), "worker": {"tp": 4}}, r"worker.gpus \(8\) must equal worker.tp \(4\)"),
    ({**values("default"), "worker": {"tp": 4, "gpus": 4}}, r"builder.gpus \(8\) must be worker.tp \(4\) or 0"),
    ({**values("default"), "worker": {"calibrationFromStore": True, "calibrationConfigMap": "c"}},
     "two sources of one calibration record: set one"),
])
def test_must_set_values_fail_with_what_to_set(vals, message):
    import helm_python as helm
    with pytest.raises(helm.HelmRenderError, match=message):
        render(vals)


# ------------------------------------------------------------------------------------------- lint, validate
@pytest.mark.parametrize("name", VALUES_FILES)
def test_helm_lint(name):
    import helm_python as helm
    report = helm.lint(str(CHART), values(name), strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("name", VALUES_FILES)
def test_rendered_manifests_are_valid_kubernetes(name, rendered, tmp_path):
    """`kubernetes-validate --strict` over every rendered file: unknown fields are errors. The Prometheus
    Operator kinds have no schema there; their content is checked by the monitoring tests below."""
    files = []
    for path, text in rendered[name].items():
        if path.endswith(".yaml") and text.strip():
            f = tmp_path / path.replace("/", "_")
            f.write_text(text)
            files.append(str(f))
    exe = tool("kubernetes-validate", "pip install kubernetes-validate")
    for version in KUBE_VERSIONS:
        r = run([exe, "--strict", "--kubernetes-version", version, *files])
        assert r.returncode == 0, r.stdout + r.stderr
        unvalidated = {line.split("kind ")[1].split()[0] for line in (r.stdout + r.stderr).splitlines()
                       if "Couldn't find schema" in line}
        assert unvalidated <= {"ServiceMonitor", "PrometheusRule"}, unvalidated
    kinds = {o["kind"] for o in objects(rendered[name])}
    assert {"StatefulSet", "Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "ServiceAccount"} <= kinds


# ------------------------------------------------------------------------------------------------- wiring
@pytest.mark.parametrize("name", VALUES_FILES)
def test_services_select_pods_and_ports_exist(name, rendered):
    objs = objects(rendered[name])
    pods = [o for o in objs if o["kind"] in WORKLOADS]
    for svc in (o for o in objs if o["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        targets = [p for p in pods if sel.items() <= p["spec"]["template"]["metadata"]["labels"].items()]
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {len(targets)} workloads"
        ports = {p["name"] for c in _pod_spec(targets[0])["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, (svc["metadata"]["name"], port)
    for pdb in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(sel.items() <= p["spec"]["template"]["metadata"]["labels"].items() for p in pods), pdb
    for w in pods:                                    # selectors match their own template
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        if w["kind"] == "StatefulSet":
            assert any(s["kind"] == "Service" and s["metadata"]["name"] == w["spec"]["serviceName"] for s in objs)


@pytest.mark.parametrize("name", VALUES_FILES)
def test_pods_run_unprivileged_with_tenant_tokens(name, rendered):
    objs = objects(rendered[name])
    secrets = {o["metadata"]["name"] for o in objs if o["kind"] == "Secret"}
    for w in (o for o in objs if o["kind"] in WORKLOADS):
        spec, c = _pod_spec(w), _container(w)
        assert spec["securityContext"]["runAsNonRoot"] is True, w["metadata"]["name"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c.get("resources", {}).get("requests"), f"{w['metadata']['name']} has no resource requests"
        if w["metadata"]["name"].endswith("-redis"):
            continue
        vols = {v["name"]: v for v in spec["volumes"]}
        secret = vols["tenants"]["secret"]["secretName"]
        assert secret in secrets or secret == values(name)["tenants"].get("existingSecret"), secret
        assert "REDIS_URL" in _env(c) and any(k.endswith("TOKENS_FILE") for k in _env(c))


def test_default_values_run_tp8_workers_on_8_gpus(rendered):
    objs = objects(rendered["default"])
    worker = find(objs, "StatefulSet", "-worker")
    c = _container(worker)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert c["image"].endswith("-cuda")
    assert c["command"] == ["redknot", "worker"] and "--tp=8" in c["args"]
    assert any(v["name"] == "dshm" and v["emptyDir"]["medium"] == "Memory" for v in _pod_spec(worker)["volumes"])
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in _pod_spec(worker)["tolerations"]
    store = find(objs, "StatefulSet", "-store")
    assert store["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "500Gi"
    assert not _container(store)["image"].endswith("-cuda")
    redis = find(objs, "StatefulSet", "-redis")
    assert _env(_container(worker))["REDIS_URL"] == f"redis://:$(REDIS_PASSWORD)@{redis['metadata']['name']}:6379/0"
    assert not [o for o in objs if o["kind"] in ("ServiceMonitor", "PrometheusRule", "Ingress")]


def test_gpu_values_pin_workers_to_the_gpu_pool(rendered):
    objs = objects(rendered["gpu"])
    worker = find(objs, "StatefulSet", "-worker")
    spec, c = _pod_spec(worker), _container(worker)
    gv = values("gpu")
    assert worker["spec"]["replicas"] == 2
    assert spec["nodeSelector"] == gv["worker"]["nodeSelector"]
    assert spec["tolerations"] == gv["worker"]["tolerations"]
    assert spec["runtimeClassName"] == "nvidia"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert c["image"] == "registry.example.com/redknot/redknot-mla:0.1.0-cuda"
    assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}]
    builder = find(objs, "Deployment", "-builder")
    assert _container(builder)["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert _container(builder)["image"].endswith("-cuda")
    ingress = find(objs, "Ingress", "-api")
    assert ingress["spec"]["tls"][0]["hosts"] == ["redknot.example.com"]
    # the public API only: /metrics, the probes and the interactive docs are not routed from outside
    paths = [p["path"] for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    assert paths == ["/v1", "/openapi.json"]
    secret = find(objs, "Secret", "-tenants")
    lines = secret["stringData"]["tokens"].splitlines()
    assert lines == [f"{t['tenant']} {t['token']}" for t in gv["tenants"]["tokens"]]


def test_local_socket_is_shared_by_the_store_and_the_workers_of_a_node(rendered):
    """store.localSocket: the store listens on a socket in a host directory that the worker pods mount at the same
    path and are told to fetch through (on another node they find none and fetch over gRPC); off by default."""
    for name, on in (("gpu", True), ("default", False)):
        objs = objects(rendered[name])
        store, worker = find(objs, "StatefulSet", "-store"), find(objs, "StatefulSet", "-worker")
        store_env, worker_env = _env(_container(store)), _env(_container(worker))
        assert ("REDKNOT_STORE_LOCAL_SOCKET" in store_env) == on, name
        assert ("REDKNOT_WORKER_STORE_LOCAL_SOCKET" in worker_env) == on, name
        if not on:
            continue
        assert store_env["REDKNOT_STORE_LOCAL_SOCKET"] == worker_env["REDKNOT_WORKER_STORE_LOCAL_SOCKET"]
        sock_dir = str(store_env["REDKNOT_STORE_LOCAL_SOCKET"]).rsplit("/", 1)[0]
        for w in (store, worker):
            vols = {v["name"]: v for v in _pod_spec(w)["volumes"]}
            mounts = {m["name"]: m["mountPath"] for m in _container(w)["volumeMounts"]}
            assert vols["local-socket"]["hostPath"]["path"] == values(name)["store"]["localSocket"]["hostPath"]
            assert mounts["local-socket"] == sock_dir


def test_gpu_resource_name_is_a_value():
    vals = {**values("default"), "gpuResourceName": "nvidia.com/mig-7g.141gb"}
    worker = find(objects(render(vals)), "StatefulSet", "-worker")
    limits = _container(worker)["resources"]["limits"]
    assert limits["nvidia.com/mig-7g.141gb"] == 8 and "nvidia.com/gpu" not in limits


def test_cpu_workers_need_no_gpus():
    vals = {**values("default"), "worker": {"gpus": 0, "tp": 2, "tolerations": []}, "builder": {"gpus": 0}}
    objs = objects(render(vals))
    for w in (find(objs, "StatefulSet", "-worker"), find(objs, "Deployment", "-builder")):
        c = _container(w)
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
        assert not c["image"].endswith("-cuda")
        assert _env(c)["REDKNOT_DEVICE"] == "cpu" and _env(c)["REDKNOT_TP"] == "2"


def test_a_calibration_configmap_gates_the_workers_reuse_arm(rendered):
    """worker.calibrationConfigMap: the record's ConfigMap mounted read-only as a directory (so an update reaches
    the pod) and the worker pointed at it; by default no record is required."""
    assert "REDKNOT_WORKER_CALIBRATION_RECORD" not in _env(_container(find(objects(rendered["default"]),
                                                                              "StatefulSet", "-worker")))
    vals = {**values("default"), "worker": {"calibrationConfigMap": "redknot-calibration"}}
    worker = find(objects(render(vals)), "StatefulSet", "-worker")
    c = _container(worker)
    assert _env(c)["REDKNOT_WORKER_CALIBRATION_RECORD"] == "/etc/redknot/calibration/calibration.json"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "calibration")
    assert mount == {"name": "calibration", "mountPath": "/etc/redknot/calibration", "readOnly": True}
    vol = next(v for v in _pod_spec(worker)["volumes"] if v["name"] == "calibration")
    assert vol["configMap"] == {"name": "redknot-calibration", "items": [{"key": "calibration.json",
                                                                          "path": "calibration.json"}]}


def test_workers_can_read_the_calibration_record_from_the_store(rendered):
    """worker.calibrationFromStore: the workers read the record `redknot calibrate --store` put in the store, every
    calibrationPollSeconds, with no ConfigMap mounted; store.adminTenants are the tenants that may put records. By
    default neither is set."""
    objs = objects(rendered["default"])
    assert "REDKNOT_WORKER_CALIBRATION_STORE" not in _env(_container(find(objs, "StatefulSet", "-worker")))
    assert "REDKNOT_STORE_ADMIN_TENANTS" not in _env(_container(find(objs, "StatefulSet", "-store")))
    vals = {**values("default"), "worker": {"calibrationFromStore": True, "calibrationPollSeconds": 10},
            "store": {"adminTenants": ["ops", "acme"]}}
    objs = objects(render(vals))
    worker = find(objs, "StatefulSet", "-worker")
    env = _env(_container(worker))
    assert env["REDKNOT_WORKER_CALIBRATION_STORE"] == "true" and env["REDKNOT_WORKER_CALIBRATION_POLL_S"] == "10"
    assert "REDKNOT_WORKER_CALIBRATION_RECORD" not in env
    assert not [v for v in _pod_spec(worker)["volumes"] if v["name"] == "calibration"]
    assert _env(_container(find(objs, "StatefulSet", "-store")))["REDKNOT_STORE_ADMIN_TENANTS"] == "ops,acme"


def test_s3_values_run_stateless_store_replicas_on_external_redis(rendered):
    objs = objects(rendered["s3"])
    store = find(objs, "StatefulSet", "-store")
    c = _container(store)
    env = _env(c)
    assert store["spec"]["replicas"] == 3 and "volumeClaimTemplates" not in store["spec"]
    assert env["REDKNOT_STORE_BACKEND"] == "s3"
    assert env["REDKNOT_STORE_S3_ENDPOINT"] == "http://minio.storage.svc:9000"
    assert c["envFrom"] == [{"secretRef": {"name": "redknot-s3"}}]
    assert env["REDIS_URL"] == {"secretKeyRef": {"name": "redknot-redis", "key": "url"}}
    assert not [o for o in objs if o["metadata"]["name"].endswith("-redis")]
    assert find(objs, "PodDisruptionBudget", "-store")["spec"]["maxUnavailable"] == 1


# --------------------------------------------------------------------------------------------- monitoring
def test_chart_ships_the_deploy_rules_and_dashboard_unchanged(rendered, tmp_path):
    assert (CHART / "files" / "alerts.rules.yml").read_bytes() == \
        (ROOT / "deploy" / "prometheus" / "alerts.rules.yml").read_bytes(), \
        "copy deploy/prometheus/alerts.rules.yml to helm/redknot/files/alerts.rules.yml"
    assert (CHART / "files" / "redknot-dashboard.json").read_bytes() == \
        (ROOT / "deploy" / "grafana" / "dashboards" / "redknot.json").read_bytes(), \
        "copy deploy/grafana/dashboards/redknot.json to helm/redknot/files/redknot-dashboard.json"
    objs = objects(rendered["gpu"])
    rule = find(objs, "PrometheusRule", "redknot")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.rules.yml").read_text())
    f = tmp_path / "rule.yml"                       # what the operator will load is valid Prometheus rules
    f.write_text(yaml.safe_dump(rule["spec"]))
    r = run([promtool(), "check", "rules", str(f)])
    assert r.returncode == 0, r.stdout + r.stderr
    dash = find(objs, "ConfigMap", "-dashboard")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["redknot.json"]) == \
        json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "redknot.json").read_text())


def test_servicemonitor_scrapes_every_metrics_port(rendered):
    objs = objects(rendered["gpu"])
    sm = find(objs, "ServiceMonitor", "redknot")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    sel = sm["spec"]["selector"]["matchLabels"]
    scraped = [o for o in objs if o["kind"] == "Service" and sel.items() <= o["metadata"]["labels"].items()]
    components = {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in scraped}
    assert components == {"store", "api", "builder", "worker"}
    (endpoint,) = sm["spec"]["endpoints"]
    for s in scraped:
        assert endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}, s["metadata"]["name"]
    assert all(o["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE for o in scraped)


def _pods(objs: list[dict]) -> dict[str, dict]:
    """component -> its pod template's labels and container ports (Deployments and StatefulSets)."""
    out = {}
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            t = o["spec"]["template"]
            ports = {p["containerPort"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
            out[t["metadata"]["labels"]["app.kubernetes.io/component"]] = {"labels": t["metadata"]["labels"],
                                                                          "ports": ports}
    return out


def _admits(policy: dict, src_labels: dict | None, port: int) -> bool:
    """Whether `policy` lets a pod of this release with `src_labels` (None: a pod elsewhere) reach `port`."""
    for rule in policy["spec"].get("ingress", []):
        if port not in {p["port"] for p in rule.get("ports", [])}:
            continue
        peers = rule.get("from")
        if peers is None:
            return True
        for peer in peers:
            if "namespaceSelector" in peer and not peer["namespaceSelector"] and "podSelector" not in peer:
                return True
            sel = peer.get("podSelector", {}).get("matchLabels")
            if src_labels is not None and sel is not None and sel.items() <= src_labels.items():
                return True
    return False


MONITORING = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


@pytest.mark.parametrize("name", ["default", "gpu"])
def test_network_policies_admit_only_the_callers_each_component_needs(name, rendered):
    """With networkPolicy.metricsFrom narrowed to a monitoring namespace: each port admits exactly the components
    that call it (the store's gRPC: API, builders, workers; Redis: store, API, builders; the workers' port: the API);
    the API is public. With the default metricsFrom (anywhere) the metrics ports are open."""
    default = {o["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: o
               for o in objects(rendered[name]) if o["kind"] == "NetworkPolicy"}
    vals = values(name)
    objs = objects(render({**vals, "networkPolicy": {"enabled": True, "metricsFrom": MONITORING}}))
    pods = _pods(objs)
    policies = {o["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: o
                for o in objs if o["kind"] == "NetworkPolicy"}
    assert set(policies) == set(pods), (set(policies), set(pods))      # every component's pods have one
    for comp, policy in policies.items():
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pods[comp]["labels"].items()
    v = chart_values(vals)
    store, api, worker = v["store"]["grpcPort"], v["api"]["port"], v["worker"]["port"]
    # (destination, its port) -> the components of this release that may call it
    callers = {("store", store): {"api", "builder", "worker"}, ("worker", worker): {"api"}}
    if "redis" in pods:
        callers[("redis", 6379)] = {"store", "api", "builder"}
    for (dest, port), allowed in callers.items():
        assert port in pods[dest]["ports"], (dest, port)
        for src, p in pods.items():
            assert _admits(policies[dest], p["labels"], port) == (src in allowed), (dest, src)
        assert not _admits(policies[dest], None, port), dest                    # nor from another namespace
    assert _admits(policies["api"], None, api)                                 # the API is public
    assert policies["worker"]["spec"]["ingress"][0]["from"][-1] == MONITORING[0]   # Prometheus scrapes the workers
    # the default metricsFrom: the metrics ports open to any namespace
    assert _admits(default["store"], None, v["store"]["metricsPort"])
    assert _admits(default["builder"], None, v["builder"]["metricsPort"])
    assert not _admits(default["store"], None, store)


def test_the_bundled_redis_requires_a_password_its_clients_carry(rendered):
    """redis.auth (on by default): Redis starts with --requirepass from a generated Secret (32 characters), its
    probes authenticate (REDISCLI_AUTH), and the store, the API and the builder get REDIS_URL with the password
    from that Secret; an existing Secret replaces the generated one."""
    objs = objects(rendered["default"])
    secret = find(objs, "Secret", "-redis")
    import base64
    assert len(base64.b64decode(secret["data"]["password"])) == 32
    redis_c = _container(find(objs, "StatefulSet", "-redis"))
    assert redis_c["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis_c["env"]}
    assert refs["REDIS_PASSWORD"] == refs["REDISCLI_AUTH"] == {"name": secret["metadata"]["name"], "key": "password"}
    clients = 0
    for o in objs:
        if o["kind"] not in ("Deployment", "StatefulSet") or o["metadata"]["name"].endswith("-redis"):
            continue
        names = [e["name"] for e in _container(o).get("env", [])]
        if "REDIS_URL" not in names:
            continue
        clients += 1
        env = _container(o)["env"]
        pw = env[names.index("REDIS_PASSWORD")]
        assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL"), o["metadata"]["name"]   # defined first
        assert pw["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "password"}
        assert env[names.index("REDIS_URL")]["value"].startswith("redis://:$(REDIS_PASSWORD)@")
    assert clients >= 3                                              # store, API, builder
    own = objects(render({**values("default"), "redis": {"auth": {"existingSecret": "my-redis"}}}))
    assert not [o for o in own if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-redis")]
    assert {e["name"]: e for e in _container(find(own, "StatefulSet", "-redis"))["env"]}["REDIS_PASSWORD"][
        "valueFrom"]["secretKeyRef"]["name"] == "my-redis"


def test_the_api_gets_a_generated_document_id_key_or_yours(rendered):
    """REDKNOT_API_ID_SECRET comes from a Secret: one the chart generates (64 hex digits the API accepts) or
    api.idSecretExistingSecret."""
    import base64
    from services.api.settings import ApiSettings
    objs = objects(rendered["default"])
    secret = find(objs, "Secret", "-api")
    key = base64.b64decode(secret["data"]["id-secret"]).decode()
    assert len(ApiSettings(id_secret=key).document_id_secret()) == 32
    env = {e["name"]: e for e in _container(find(objs, "Deployment", "-api"))["env"]}
    assert env["REDKNOT_API_ID_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"],
                                                                          "key": "id-secret"}
    own = objects(render({**values("default"), "api": {"idSecretExistingSecret": "my-ids"}}))
    assert not [o for o in own if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-api")]
    env = {e["name"]: e for e in _container(find(own, "Deployment", "-api"))["env"]}
    assert env["REDKNOT_API_ID_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "my-ids"


def test_workers_and_builders_divide_their_pods_cpu_share_among_their_ranks(rendered):
    """Each TP rank's torch threads come from the pod's CPU share (services/common/tp.py rank_threads): the chart
    passes the container's CPU limit where it has one, else its request, through the downward API."""
    objs = objects(rendered["default"])
    for w in (find(objs, "StatefulSet", "-worker"), find(objs, "Deployment", "-builder")):
        ref = _env(_container(w))["REDKNOT_CPUS"]["resourceFieldRef"]
        assert ref == {"resource": "requests.cpu", "divisor": "1"}          # the defaults request CPUs, no limit
    vals = {**values("default"), "worker": {"resources": {"requests": {"cpu": "8"}, "limits": {"cpu": "12"}}}}
    ref = _env(_container(find(objects(render(vals)), "StatefulSet", "-worker")))["REDKNOT_CPUS"]["resourceFieldRef"]
    assert ref == {"resource": "limits.cpu", "divisor": "1"}
