"""The local stack (`make demo`, bench/serve_ttft.py, the service tests) picks its services' ports free before any
of them binds one and wires them into each other's settings; a port another process takes in between must not fail
the start: the stack stops what it started and starts again on fresh ports."""
from __future__ import annotations

import socket

import redis

from services.common import stack as stack_mod
from services.common.stack import LocalStack, StackConfig, StackError, http_ok

from .conftest import write_tiny_checkpoint


def test_a_port_taken_before_its_service_binds_it_starts_the_stack_on_fresh_ports(tmp_path_factory, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()                                    # another process's server on the port the stack picks first
    held = taken.getsockname()[1]
    real, handed = stack_mod.free_port, []

    def free_port():                                  # the race, made certain: redis's first port is the held one
        port = held if not handed else real()
        handed.append(port)
        return port
    monkeypatch.setattr(stack_mod, "free_port", free_port)
    checkpoint = write_tiny_checkpoint(tmp_path_factory)
    st = LocalStack(StackConfig(workdir=tmp_path_factory.mktemp("stack"), model=checkpoint, prefix="ports"))
    assert st.ports["redis"] == held
    try:
        st.start(defer=("builder", "worker"))
        assert st.ports["redis"] != held and len(handed) == 12          # two sets of six ports: one retry
        assert "already in use" in (st.workdir / "logs" / "redis.log").read_text().lower()
        with redis.Redis.from_url(st.redis_url) as r:     # the stack's own Redis and API answer on the new ports
            assert r.info("server")["process_id"] == st.services["redis"].proc.pid
        assert http_ok(st.api_url + "/healthz")
    finally:
        codes = st.stop()
        taken.close()
    assert all(c in (0, None) for c in codes.values()), codes


def test_a_start_that_fails_for_another_reason_is_not_tried_again(tmp_path_factory, monkeypatch):
    checkpoint = write_tiny_checkpoint(tmp_path_factory)
    calls = []
    real = stack_mod.free_port
    monkeypatch.setattr(stack_mod, "free_port", lambda: calls.append(1) or real())
    st = LocalStack(StackConfig(workdir=tmp_path_factory.mktemp("stack"), model=checkpoint, prefix="ports",
                                store_env={"REDKNOT_STORE_BACKEND": "no-such-backend"}))
    try:
        st.start(defer=("builder", "worker"))
        raise AssertionError("the store started with an unknown backend")
    except StackError as e:
        assert "store" in str(e)
    finally:
        st.stop()
    assert len(calls) == 6                             # one set of ports: no retry
