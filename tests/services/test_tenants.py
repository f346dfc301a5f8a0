"""Token tables follow their file: added, rotated and revoked tokens take effect without a restart; a file that
stops parsing keeps the table in force."""
from __future__ import annotations

import time

import pytest

from services.common.tenants import Tenants
from services.store import auth
from services.store.auth import TokenTable

A, B, C = "a-token-0123456789abcdef", "b-token-0123456789abcdef", "c-token-0123456789abcdef"


@pytest.fixture(autouse=True)
def look_every_time(monkeypatch):
    monkeypatch.setattr(auth, "WATCH_PERIOD_S", 0.0)


def rewrite(path, text: str) -> None:
    before = path.stat().st_mtime_ns
    path.write_text(text)
    while path.stat().st_mtime_ns == before:      # a coarse clock: make the change visible (bounded by the test)
        time.sleep(0.01)
        path.write_text(text)


@pytest.mark.parametrize("load", [lambda f: Tenants.load(file=str(f)), lambda f: TokenTable.parse(file=str(f))])
def test_a_tokens_file_is_followed(tmp_path, load):
    f = tmp_path / "tokens"
    f.write_text(f"acme {A}\nglobex {B}\n")
    table = load(f)
    assert table.tenant(A) == "acme" and table.tenant(B) == "globex" and table.tenant(C) is None
    rewrite(f, f"acme {C}\nglobex {B}\n")               # acme's token rotated
    assert table.tenant(A) is None and table.tenant(C) == "acme" and table.tenant(B) == "globex"
    rewrite(f, f"acme {C}\n")                           # globex revoked
    assert table.tenant(B) is None and table.tenant(C) == "acme"
    for bad in (f"acme {C}\nglobex {C}\n", "acme short\n", "acme\n", f"Bad/Name {A}\n"):
        rewrite(f, bad)                                  # refused whole: the table in force stays
        assert table.tenant(C) == "acme" and table.tenant(A) is None and len(table) == 1
    f.unlink()                                           # gone (a Secret being swapped): kept as well
    assert table.tenant(C) == "acme"


def test_a_token_string_is_fixed_and_tenants_give_their_tokens(tmp_path):
    t = Tenants.load(f"acme={A},globex={B}")
    assert t.tenant(A) == "acme" and t.token("globex") == B and len(t) == 2
    f = tmp_path / "tokens"
    f.write_text(f"acme {A}\n")
    t = Tenants.load(file=str(f))
    rewrite(f, f"acme {C}\n")
    assert t.token("acme") == C
