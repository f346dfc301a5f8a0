"""Settings come from flags, then env, then defaults; tokens parse strictly; the CLI keeps web/RPC imports
out of `runtime/` until `store serve` runs."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from services.store.auth import TokenTable
from services.store.settings import Settings

from .conftest import ROOT


def test_flags_over_env_over_defaults():
    p = argparse.ArgumentParser()
    Settings.add_arguments(p)
    env = {"REDKNOT_STORE_LISTEN": "0.0.0.0:1", "REDIS_URL": "redis://r:1/0", "REDKNOT_STORE_MAX_SHARD_BYTES": "5"}
    s = Settings.from_args(p.parse_args(["--listen", "127.0.0.1:2", "--grace-s", "1.5"]), env=env)
    assert (s.listen, s.redis_url, s.max_shard_bytes, s.grace_s) == ("127.0.0.1:2", "redis://r:1/0", 5, 1.5)
    assert Settings.from_args(None, env={}).listen == Settings().listen
    with pytest.raises(ValueError):
        Settings(backend="ftp")
    with pytest.raises(ValueError):
        Settings(tls_client_ca="ca.pem")
    s = Settings.from_args(None, env={"REDKNOT_STORE_STREAM_IDLE_S": "2.5", "REDKNOT_STORE_GC_INTERVAL_S": "0"})
    assert (s.stream_idle_s, s.stream_deadline_s, s.gc_interval_s) == (2.5, 3600.0, 0.0)
    for name in ("stream_idle_s", "stream_deadline_s", "gc_interval_s", "redis_health_check_s"):
        with pytest.raises(ValueError):
            Settings(**{name: -1.0})
    s = Settings.from_args(None, env={"REDKNOT_STORE_ADMIN_TENANTS": " ops, acme ,"})
    assert s.admins() == {"ops", "acme"} and Settings().admins() == frozenset()
    with pytest.raises(ValueError, match="not a tenant name"):
        Settings(admin_tenants="ops,../x")


def test_token_table(tmp_path):
    f = tmp_path / "tokens"
    f.write_text("# tenants\nacme aaaaaaaaaaaaaaaaaaaa\n\nglobex bbbbbbbbbbbbbbbbbbbb  # ops\n")
    t = TokenTable.parse("initech=cccccccccccccccccccc", str(f))
    assert (t.tenant("aaaaaaaaaaaaaaaaaaaa"), t.tenant("cccccccccccccccccccc"), t.tenant("nope"), t.tenant("")) == \
        ("acme", "initech", None, None)
    for bad in ("acme=short", "../x=aaaaaaaaaaaaaaaaaaaa", "acme:aaaaaaaaaaaaaaaaaaaa",
                "a=aaaaaaaaaaaaaaaaaaaa,b=aaaaaaaaaaaaaaaaaaaa"):
        with pytest.raises(Exception):
            TokenTable.parse(bad)


def test_cli_imports_no_rpc_stack():
    code = ("import sys, services.cli; import services.cli as c; "
            "assert not {'grpc', 'redis', 'boto3', 'prometheus_client'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
    r = subprocess.run([sys.executable, "-m", "services.cli", "store", "serve", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "REDKNOT_STORE_TOKENS_FILE" in r.stdout
