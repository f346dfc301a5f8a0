"""Prometheus config, alert rules and their unit tests (promtool), the Grafana dashboard, and the contract that
every query uses only metric names, labels and label values the services really export, read from live
/metrics scrapes: `redknot store serve` after real traffic, and the API, builder and worker of a local stack
on the demo model (falling back to the registries their metrics modules build, then to docs/metrics.md, for
a service whose code is not there)."""
from __future__ import annotations

import importlib
import json
import re
import urllib.request
import uuid
from dataclasses import dataclass, field

import grpc
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ROOT, _cleanup_prefix, promtool, run
from .promql import usage

RULES = ROOT / "deploy" / "prometheus" / "alerts.rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "redknot.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"
SERVICES = ("api", "worker", "builder")          # besides the store, whose metrics are scraped live


# ------------------------------------------------------------------------------------------------ promtool
def test_promtool_checks_config_and_rules():
    r = run([promtool(), "check", "config", str(ROOT / "deploy" / "prometheus.yml")])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 rule files found" in r.stdout + r.stderr, "prometheus.yml loads the alert rules"
    r = run([promtool(), "check", "rules", str(RULES)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_unit_tests_of_the_alerts():
    r = run([promtool(), "test", "rules", "alerts.test.yml"], cwd=RULES.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    tested = set(re.findall(r"alertname:\s*(\w+)", (RULES.parent / "alerts.test.yml").read_text()))
    assert tested == {r["alert"] for r in _rules()}, "every alert has a unit test"


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_alerts_cover_fallbacks_digests_store_errors_and_build_backlog():
    by_metric = {}
    for r in _rules():
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        for s in usage(r["expr"]).selectors:
            by_metric.setdefault(s.metric, []).append(r["alert"])
    assert "redknot_fallbacks_total" in by_metric                      # fallback rate
    assert "redknot_store_digest_failures_total" in by_metric          # digest failures
    assert "redknot_store_rpcs_total" in by_metric                     # store errors
    assert "redknot_build_queue_depth" in by_metric                    # build queue backlog
    assert "up" in by_metric                                           # a service down, no builder at all
    assert "redknot_api_responses_total" in by_metric                  # 5xx share
    assert "redknot_time_to_first_token_seconds_bucket" in by_metric   # the TTFT objective


# ----------------------------------------------------------------------------------------------- dashboard
def _dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def test_dashboard_queries_are_valid_promql(tmp_path):
    """promtool parses every panel query (as a recording rule; Grafana's $__rate_interval as 5m)."""
    rules = [{"record": f"dashboard:query_{i}", "expr": re.sub(r"\$__rate_interval", "5m", expr)}
             for i, (_, expr) in enumerate(_dashboard_queries())]
    f = tmp_path / "dashboard.rules.yml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = run([promtool(), "check", "rules", str(f)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_shows_what_operators_need():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "redknot-mla"
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "job", "instance"]
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"]), "panel ids are unique"
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]

    def used(metric: str, grouped_by: str | None = None) -> bool:
        for _, expr in _dashboard_queries():
            u = usage(expr)
            if any(s.metric == metric for s in u.selectors) and (grouped_by is None or grouped_by in u.grouping_labels):
                return True
        return False

    assert used("redknot_ttft_seconds_bucket", "arm")                                    # TTFT by arm
    assert used("redknot_head_row_saving_ratio_sum")                                     # namespace 1
    assert used("redknot_token_row_saving_ratio_sum")                                    # namespace 2
    assert used("redknot_flop_saving_ratio_sum", "op")                                   # namespace 3
    assert used("redknot_ttft_seconds_sum", "arm")                                       # namespace 4
    assert used("redknot_fallbacks_total", "reason")                                     # fallbacks by reason
    assert used("redknot_store_bytes_in_total") and used("redknot_store_bytes_out_total")  # store throughput
    assert used("redknot_cache_tier_requests_total", "result")                           # cache-tier hits
    assert used("redknot_build_queue_depth") and used("redknot_builds_total", "result")  # build queue
    assert used("redknot_requests_running", "instance") and used("redknot_requests_waiting", "instance")
    assert used("redknot_request_queue_seconds_bucket") and used("redknot_time_to_first_token_seconds_bucket", "arm")
    # every query follows the job and instance filter
    for title, expr in _dashboard_queries():
        for sel in usage(expr).selectors:
            assert {("job", "=~"), ("instance", "=~")} <= {(label, op) for label, op, _ in sel.matchers}, (title, expr)
            assert '{job=~"$job",instance=~"$instance"' in expr.replace(" ", ""), (title, expr)
    # the fallback share is over reuse-arm requests (the recompute arm cannot fall back), as its alert computes it
    shares = [expr for title, expr in _dashboard_queries() if title == "Fallback share"]
    assert shares and all('arm="reuse"' in e for e in shares)


# ------------------------------------------------------------------------------- the exported metric names
@dataclass
class Family:
    type: str
    source: str
    labels: set[str] = field(default_factory=set)
    values: dict[str, set[str]] = field(default_factory=dict)      # label -> values seen

    def sample_names(self, name: str) -> set[str]:
        return {"counter": {f"{name}_total"}, "gauge": {name}, "histogram": {f"{name}_bucket", f"{name}_sum",
                f"{name}_count"}, "summary": {name, f"{name}_sum", f"{name}_count"}}[self.type]


def _parse(text: str, source: str, into: dict[str, Family]) -> None:
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("redknot_") or fam.name.endswith("_created"):
            continue                                  # _created: prometheus_client's creation timestamps
        f = into.setdefault(fam.name, Family(fam.type, source))
        assert f.type == fam.type, f"{fam.name} is a {f.type} in {f.source} and a {fam.type} in {source}"
        for s in fam.samples:
            for k, v in s.labels.items():
                if k != "le":
                    f.labels.add(k)
                    f.values.setdefault(k, set()).add(v)


def _registry_families(module_name: str) -> dict[str, Family]:
    """Every metric the module's *Metrics classes register, on a fresh registry each."""
    mod = importlib.import_module(module_name)
    out: dict[str, Family] = {}
    classes = [c for n, c in vars(mod).items() if n.endswith("Metrics") and isinstance(c, type)
               and c.__module__ == mod.__name__]
    assert classes, f"{module_name} defines no *Metrics class"
    for cls in classes:
        inst = cls(CollectorRegistry())
        _parse(generate_latest(inst.registry).decode(), module_name, out)
        for m in vars(inst).values():                 # label names of metrics with no child yet
            if isinstance(m, MetricWrapperBase) and m._name.removesuffix("_total") in out:
                out[m._name.removesuffix("_total")].labels |= set(m._labelnames)
    return out


_DOC_TYPES = {"counter": "counter", "gauge": "gauge", "histogram": "histogram"}


def _doc_families(section: str) -> dict[str, Family]:
    """The table rows of one section of docs/metrics.md (the contract) as families."""
    text = METRICS_DOC.read_text()
    part = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    out = {}
    for row in re.findall(r"^\| `(redknot_\w+)` \| (\w+)[^|]*\| ([^|]*)\|", part, re.MULTILINE):
        name, typ, labels = row
        name = name.removesuffix("_total") if typ == "counter" else name
        f = Family(_DOC_TYPES[typ], f"docs/metrics.md ({section})")
        for label, vals in re.findall(r"`(\w+)`(?: \(([^)]*)\))?", labels):
            f.labels.add(label)
            if vals and re.fullmatch(r"\w+(, \w+)*", vals):       # a list of values, not a description
                f.values[label] = {v.strip() for v in vals.split(",")}
        out[name] = f
    return out


def _live_store_families(store) -> dict[str, Family]:
    """Scrape a running store after real traffic (a generation written, fetched, listed) and a refused call,
    so the labelled families have children to show."""
    from services.store.client import StoreClient
    from tests.services.conftest import doc_key, fetch_all, make_generation
    key = doc_key("deploy-metrics", tp_size=1)
    with store.client() as c:
        c.put_generation(key, make_generation(key, layers=1, size=256))
        assert fetch_all(c, key, 0)
        assert c.list_documents()
    with StoreClient(store.target, "not-a-tenant-token-0123456789") as c, pytest.raises(Exception):
        c.list_documents()
    text = urllib.request.urlopen(f"http://127.0.0.1:{store.metrics_port}/metrics", timeout=5).read().decode()
    out: dict[str, Family] = {}
    _parse(text, "live store /metrics", out)
    assert "UNAUTHENTICATED" in out["redknot_store_rpcs"].values["code"]
    return out


def _live_service_families(tmp_path, redis_url) -> dict[str, dict[str, Family]] | None:
    """Scrape the API, builder and worker of a real local stack (services/common/stack.py: the processes
    `redknot demo` runs) on the small demo model, TP1; None when that module does not exist yet."""
    try:
        from services.common.stack import LocalStack, StackConfig
    except ModuleNotFoundError:
        return None
    from rich.console import Console

    from runtime.demo import ensure_checkpoint
    checkpoint = ensure_checkpoint(ROOT / ".cache" / "demo", Console(quiet=True))   # shared with `redknot demo`
    prefix = f"rkdeploy-{uuid.uuid4().hex[:8]}"
    stack = LocalStack(StackConfig(workdir=tmp_path / "stack", model=checkpoint, tp=1, redis_url=redis_url,
                                   prefix=prefix))
    out: dict[str, dict[str, Family]] = {}
    try:
        with stack:
            for svc, target in stack.metrics_targets().items():
                if svc in SERVICES:
                    text = urllib.request.urlopen(f"http://{target}/metrics", timeout=10).read().decode()
                    _parse(text, f"live {svc} /metrics", out.setdefault(svc, {}))
    finally:
        _cleanup_prefix(redis_url, prefix)
        _cleanup_prefix(redis_url, f"{prefix}-store")
    return out


def _merge(into: dict[str, Family], found: dict[str, Family]) -> None:
    for name, f in found.items():
        if name not in into:
            into[name] = f
            continue
        assert into[name].type == f.type, f"{name}: {into[name].type} in {into[name].source}, {f.type} in {f.source}"
        into[name].labels |= f.labels                 # the API and the workers may both export a family
        for k, v in f.values.items():
            into[name].values.setdefault(k, set()).update(v)


@pytest.fixture(scope="module")
def exported(store_process, redis_url, tmp_path_factory) -> dict[str, Family]:
    """Every family the services export, by the best source there is: a live scrape (the store always; the
    API, builder and worker when the local stack exists), else the registry their metrics module builds,
    else the rows of docs/metrics.md."""
    fams = _live_store_families(store_process)
    assert {"redknot_store_rpcs", "redknot_store_digest_failures", "redknot_store_bytes_in"} <= fams.keys()
    live = _live_service_families(tmp_path_factory.mktemp("stack"), redis_url) or {}
    for svc in SERVICES:
        if svc in live:
            _merge(fams, live[svc])
            continue
        try:
            _merge(fams, _registry_families(f"services.{svc}.metrics"))
        except ModuleNotFoundError:
            _merge(fams, _doc_families("Build queue" if svc == "builder" else "API and inference workers"))
    sources = {f.source for f in fams.values()}
    print("metric sources:", sorted(sources))
    return fams


def _known_values() -> dict[str, set[str]]:
    """Label value sets defined in code, whatever a scrape happens to show."""
    from runtime.reuse.certificate import FallbackReason
    from services.store.pb import artifact_store_pb2 as pb
    (service,) = pb.DESCRIPTOR.services_by_name.values()
    return {"reason": {r.value for r in FallbackReason}, "code": {c.name for c in grpc.StatusCode},
            "method": {m.name for m in service.methods}}


def _queries() -> list[tuple[str, str]]:
    return [(f"alert {r['alert']}", r["expr"]) for r in _rules()] + \
           [(f"panel {title!r}", expr) for title, expr in _dashboard_queries()]


# series Prometheus makes itself for every target, with the labels our scrape configs give them
# (deploy/prometheus.yml's static labels, the chart's ServiceMonitor relabeling)
PROMETHEUS_SERIES = {"up": {"job", "instance", "component"}}
TARGET_LABELS = {"job", "instance"}        # Prometheus adds them to every series it scrapes
COMPONENTS = {"api", "worker", "store", "builder"}


def test_dashboard_and_alerts_query_only_exported_metrics(exported):
    names = {s: (n, f) for n, f in exported.items() for s in f.sample_names(n)}
    known = _known_values()
    problems = []
    for where, expr in _queries():
        u = usage(expr)
        assert u.selectors, f"{where} queries no metric"
        labels_here = set()
        for sel in u.selectors:
            if sel.metric in PROMETHEUS_SERIES:
                labels_here |= PROMETHEUS_SERIES[sel.metric]
                for label, op, value in sel.matchers:
                    if label not in PROMETHEUS_SERIES[sel.metric]:
                        problems.append(f"{where}: {sel.metric} has no label {label!r}")
                    elif label == "component" and not set(value.split("|")) <= COMPONENTS:
                        problems.append(f"{where}: no target has component {value!r}")
                continue
            if sel.metric not in names:
                problems.append(f"{where}: {sel.metric} is not exported by any service")
                continue
            family_name, fam = names[sel.metric]
            allowed = fam.labels | TARGET_LABELS | ({"le"} if sel.metric.endswith("_bucket") else set())
            labels_here |= allowed
            for label, op, value in sel.matchers:
                if label not in allowed:
                    problems.append(f"{where}: {family_name} has no label {label!r} (has {sorted(allowed)})")
                    continue
                values = known.get(label) or fam.values.get(label)
                alternatives = value.split("|") if op in ("=~", "!~") else [value]
                for v in alternatives:
                    if values and re.fullmatch(r"\w+", v) and v not in values:
                        problems.append(f"{where}: {family_name}{{{label}}} never takes the value {v!r} "
                                        f"(values: {sorted(values)})")
        for label in u.grouping_labels - labels_here:
            problems.append(f"{where}: groups by {label!r}, which none of its metrics has")
    assert not problems, "\n".join(problems)


def test_the_store_exports_what_docs_metrics_md_lists(exported):
    """The store's section of the contract against the live scrape: same names, nothing extra."""
    text = METRICS_DOC.read_text().split("## Artifact store", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(redknot_store_\w+)`", text))
    live = {s for n, f in exported.items() if n.startswith("redknot_store_") for s in f.sample_names(n)}
    bare = {s.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for s in live}
    assert documented <= live | bare, documented - (live | bare)
    assert {n for n in exported if n.startswith("redknot_store_")} == \
        {d.removesuffix("_total") for d in documented}


@pytest.mark.parametrize("svc, section", [("api", "API and inference workers"), ("worker", "API and inference workers"),
                                          ("builder", "Build queue")])
def test_service_metrics_modules_match_docs_metrics_md(svc, section):
    """Each service's metrics module registers its names of the contract, with the documented types and labels."""
    try:
        found = _registry_families(f"services.{svc}.metrics")
    except ModuleNotFoundError:
        pytest.skip(f"services/{svc}/metrics.py does not exist yet; the dashboard is checked against docs/metrics.md")
    doc = _doc_families(section)
    for name, f in found.items():
        assert name in doc, f"services/{svc}/metrics.py exports {name}, which docs/metrics.md does not list"
        assert f.type == doc[name].type, (name, f.type, doc[name].type)
        assert f.labels == doc[name].labels, (name, f.labels, doc[name].labels)
    if svc == "builder":
        assert set(doc) == set(found), set(doc) ^ set(found)
