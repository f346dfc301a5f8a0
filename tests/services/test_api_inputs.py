"""Hostile inputs against the artifact API (issue 33): `redknot api serve` as a process on loopback over a real Redis,
driven over real HTTP (httpx, and raw sockets where a client would fix the request up). Every bad input must get a
4xx with a JSON error body that says what is wrong, echo nothing large back, and change no byte in Redis. Then:
Redis down (a redis-server of the test's own, stopped) answers 503 with Retry-After, a slow body 408, a broken
record a 409 for that document only, and /metrics counts every response by route template and status.

No worker runs: every request here is refused before the API would call one (its URL is a closed port)."""
from __future__ import annotations

import json
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from runtime.model.checkpoint import load_tokenizer
from services.api.settings import ApiSettings
from services.common.build_queue import queue_tag
from services.common.stack import Service, free_port, http_ok

from .conftest import retry_if_port_taken, scrape, started_redis_service, write_tiny_checkpoint

TENANTS = {"acme": "acme-token-0123456789abcdef", "globex": "globex-token-0123456789abcdef",
           "broken": "broken-token-0123456789abcdef", "counted": "counted-token-0123456789abcdef"}
MAX_UPLOAD = 64 << 10
ID_SECRET = "5a" * 32
MAX_GENERATE = 16 << 10
MAX_BODY = 1 << 10
MAX_TOKENS = 2048
BODY_TIMEOUT_S = 1.5
HEAD_TIMEOUT_S = 1.5
MAX_ERROR_BYTES = 4096          # an error body is short: it never echoes the input back whole


# ------------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory)


def api_service(workdir: Path, checkpoint: Path, redis_url: str, prefix: str, **settings) -> tuple[Service, str]:
    workdir.mkdir(parents=True, exist_ok=True)
    tokens = workdir / "tokens"
    tokens.write_text("".join(f"{t} {tok}\n" for t, tok in TENANTS.items()))
    # the API's port comes from free_port() (worker_url and store are addresses nothing listens on, never bound):
    # started again on a fresh port while another process took it first
    return retry_if_port_taken(lambda: _start_api(workdir, checkpoint, redis_url, prefix, tokens, settings))


def _start_api(workdir: Path, checkpoint: Path, redis_url: str, prefix: str, tokens: Path,
               settings: dict) -> tuple[Service, str]:
    port = free_port()
    s = ApiSettings(**{**dict(redis_url=redis_url, redis_prefix=prefix, tokens_file=str(tokens), model=str(checkpoint),
                              listen=f"127.0.0.1:{port}", worker_url=f"http://127.0.0.1:{free_port()}",
                              store=f"127.0.0.1:{free_port()}", max_upload_bytes=MAX_UPLOAD,
                              max_generate_bytes=MAX_GENERATE, max_body_bytes=MAX_BODY,
                              max_document_tokens=MAX_TOKENS, body_timeout_s=BODY_TIMEOUT_S,
                              head_timeout_s=HEAD_TIMEOUT_S, id_secret=ID_SECRET), **settings})
    url = f"http://127.0.0.1:{port}"
    svc = Service("api", [sys.executable, "-m", "services.cli", "api", "serve"],
                  {"PYTHONUNBUFFERED": "1", **s.to_env()}, workdir / "api.log", lambda: http_ok(url + "/healthz"))
    svc.start(Path(__file__).resolve().parents[2])
    try:
        svc.wait_ready(120)
    except BaseException:
        svc.kill()
        raise
    return svc, url


@pytest.fixture(scope="module")
def app(tmp_path_factory, checkpoint, redis_url):
    prefix = f"rkin-{uuid.uuid4().hex[:8]}"
    svc, url = api_service(tmp_path_factory.mktemp("api"), checkpoint, redis_url, prefix)
    yield {"url": url, "prefix": prefix, "redis_url": redis_url, "port": int(url.rsplit(":", 1)[1])}
    code = svc.stop()
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        r.delete(*keys)
    assert code == 0, svc.log()


def client(app, tenant: str | None = "acme") -> httpx.Client:
    headers = {"Authorization": f"Bearer {TENANTS[tenant]}"} if tenant else {}
    return httpx.Client(base_url=app["url"], headers=headers, timeout=30)


def snapshot(app) -> dict[str, tuple]:
    """Every key of the API's prefix: its type, its serialized value (DUMP) and whether it expires."""
    r = redis.Redis.from_url(app["redis_url"])
    out = {}
    for k in sorted(r.scan_iter(match=f"{app['prefix']}:*", count=1000)):
        out[k] = (r.type(k), r.dump(k), r.pttl(k) > 0)
    return out


def raw_http(port: int, request: bytes, timeout: float = 10.0, pace: float = 0.0) -> tuple[int, dict, bytes]:
    """Send bytes as they are (a byte at a time every `pace` s when given); read the answer until the server
    closes or its Content-Length is in. (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            if pace:
                for i in range(len(request)):
                    sock.sendall(request[i:i + 1])
                    time.sleep(pace)
            else:
                sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass                                # the server answered and closed before we finished
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep:
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
                if "content-length" in headers and len(body) >= int(headers["content-length"]):
                    break
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), data[:200]
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def raw_request(method: str, path: str, body: bytes = b"", headers: dict | None = None, tenant: str = "acme",
                declared: int | None = None) -> bytes:
    h = {"Host": "127.0.0.1", "Content-Length": str(len(body) if declared is None else declared),
         "Authorization": f"Bearer {TENANTS[tenant]}", **(headers or {})}
    return (f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n").encode(
        "latin-1") + body


def upload(c: httpx.Client, text: str) -> str:
    r = c.post("/v1/documents", json={"text": text})
    assert r.status_code in (200, 202), r.text
    return r.json()["id"]


def multipart(parts: list[tuple[str, bytes, str | None]], boundary: str = "rkboundary") -> tuple[bytes, dict]:
    """A multipart body by hand: (name, bytes, filename or None for a text field)."""
    out = b""
    for name, data, filename in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), {"Content-Type": f"multipart/form-data; boundary={boundary}"}


# --------------------------------------------------------------------------------------------- bad inputs

def test_hostile_inputs_get_a_clear_4xx_and_change_nothing(app, checkpoint, record_property):
    vocab = load_tokenizer(checkpoint).get_vocab_size()
    acme, globex, anon = client(app), client(app, "globex"), client(app, None)
    doc = upload(acme, "The river runs past the old mill and under the stone bridge. " * 2)
    other = upload(globex, "Nobody in the town remembers when the bridge was built. " * 2)
    huge = b"x" * (8 << 20)
    J = {"Content-Type": "application/json"}

    def gen(**kw) -> dict:
        return {"documents": [doc], "question": "Where does the river begin?", **kw}

    def chunks(total: int, size: int = 64 << 10):
        for _ in range(total // size):
            yield b"1" * size

    mp_bad_text, mp_h = multipart([("text", b"ok \xff\xfe bad", None)])
    mp_invisible, _ = multipart([("text", "\u200b\u2060\u200d".encode(), None)])
    mp_both, _ = multipart([("file", b"a document", "d.txt"), ("text", b"another", None)])
    mp_two_files, _ = multipart([("file", b"one", "a.txt"), ("file", b"two", "b.txt")])
    mp_two_texts, _ = multipart([("text", b"one", None), ("text", b"two", None)])
    mp_file_text_name, _ = multipart([("text", b"a document", "d.txt")])
    mp_nul_file, _ = multipart([("file", b"\x00\x00\x00", "d.txt")])
    deep = b"[" * 5000 + b"]" * 5000
    # (name, a thunk sending the request -> (status, headers, body bytes), the status wanted)
    H = lambda r: (r.status_code, r.headers, r.content)       # noqa: E731
    P = app["port"]
    cases = [
        # page tokens and sizes (issue 33: "²" and 20 digits were 500s)
        ("page_token superscript two", lambda: H(acme.get("/v1/documents?page_token=%C2%B2")), 422),
        ("page_token 20 digits", lambda: H(acme.get("/v1/documents?page_token=99999999999999999999")), 422),
        ("page_token past 10^9", lambda: H(acme.get("/v1/documents?page_token=1000000001")), 422),
        ("page_token negative", lambda: H(acme.get("/v1/documents?page_token=-1")), 422),
        ("page_token letters", lambda: H(acme.get("/v1/documents?page_token=abc")), 422),
        ("page_token empty", lambda: H(acme.get("/v1/documents?page_token=")), 422),
        ("page_token bad UTF-8", lambda: H(acme.get("/v1/documents?page_token=%FF%FE")), 422),
        ("page_token arabic digits", lambda: H(acme.get("/v1/documents?page_token=%D9%A3")), 422),
        ("page_size zero", lambda: H(acme.get("/v1/documents?page_size=0")), 422),
        ("page_size 101", lambda: H(acme.get("/v1/documents?page_size=101")), 422),
        ("page_size true", lambda: H(acme.get("/v1/documents?page_size=true")), 422),
        ("page_size float", lambda: H(acme.get("/v1/documents?page_size=2.5")), 422),
        # strict JSON
        ("lone surrogate in text", lambda: H(acme.post("/v1/documents", content=b'{"text": "a\\ud800b"}',
                                                       headers=J)), 422),
        ("lone surrogate with tokens", lambda: H(acme.post("/v1/documents", content=b'{"text": "\\udfff", '
                                                           b'"tokens": [1]}', headers=J)), 422),
        ("lone surrogate in question", lambda: H(acme.post("/v1/generate", content=json.dumps(
            gen(question="q \ud800")).encode(), headers=J)), 422),
        ("lone surrogate as a key", lambda: H(acme.post("/v1/generate", content=b'{"\\ud800": 1}', headers=J)), 422),
        ("encoded surrogate bytes", lambda: H(acme.post("/v1/documents", content=b'{"text": "a\xed\xa0\x80"}',
                                                        headers=J)), 422),
        ("invalid UTF-8 JSON", lambda: H(acme.post("/v1/documents", content=b'{"text": "a\xffb"}', headers=J)), 422),
        ("UTF-8 BOM", lambda: H(acme.post("/v1/documents", content=b'\xef\xbb\xbf{"text": "abc"}', headers=J)), 422),
        ("UTF-16 JSON", lambda: H(acme.post("/v1/documents", content='{"text": "abc"}'.encode("utf-16"),
                                            headers=J)), 422),
        ("duplicate key upload", lambda: H(acme.post("/v1/documents", content=b'{"text": "a", "text": "b"}',
                                                     headers=J)), 422),
        ("duplicate key generate", lambda: H(acme.post("/v1/generate", content=(
            '{"documents": ["%s"], "question": "q", "question": "r"}' % doc).encode(), headers=J)), 422),
        ("duplicate key nested", lambda: H(acme.post("/v1/generate", content=(
            '{"documents": ["%s"], "question": "q", "x": {"a": 1, "a": 2}}' % doc).encode(), headers=J)), 422),
        ("NaN token", lambda: H(acme.post("/v1/documents", content=b'{"tokens": [3, NaN]}', headers=J)), 422),
        ("Infinity token", lambda: H(acme.post("/v1/documents", content=b'{"tokens": [3, Infinity]}',
                                               headers=J)), 422),
        ("overflowing float", lambda: H(acme.post("/v1/documents", content=b'{"tokens": [3, 1e400]}',
                                                  headers=J)), 422),
        ("5000-digit integer", lambda: H(acme.post("/v1/documents", content=b'{"tokens": [' + b"7" * 5000 + b"]}",
                                                   headers=J)), 422),
        ("nested 5000 deep", lambda: H(acme.post("/v1/documents", content=deep, headers=J)), 422),
        ("malformed JSON", lambda: H(acme.post("/v1/documents", content=b"{not json", headers=J)), 422),
        ("JSON array body", lambda: H(acme.post("/v1/generate", content=b"[1, 2]", headers=J)), 422),
        ("JSON null body", lambda: H(acme.post("/v1/documents", content=b"null", headers=J)), 422),
        # strict types
        ("booleans as token ids", lambda: H(acme.post("/v1/documents", json={"tokens": [True, False]})), 422),
        ("floats as token ids", lambda: H(acme.post("/v1/documents", json={"tokens": [3.0, 4.0]})), 422),
        ("strings as token ids", lambda: H(acme.post("/v1/documents", json={"tokens": ["3", "4"]})), 422),
        ("nested token ids", lambda: H(acme.post("/v1/documents", json={"tokens": [[3, 4]]})), 422),
        ("out-of-vocabulary id", lambda: H(acme.post("/v1/documents", json={"tokens": [3, vocab]})), 422),
        ("negative id", lambda: H(acme.post("/v1/documents", json={"tokens": [3, -1]})), 422),
        ("id past int64", lambda: H(acme.post("/v1/documents", json={"tokens": [3, 10**30]})), 422),
        ("text is a number", lambda: H(acme.post("/v1/documents", json={"text": 42})), 422),
        ("text and tokens null", lambda: H(acme.post("/v1/documents", json={"text": None, "tokens": None})), 422),
        ("unknown field", lambda: H(acme.post("/v1/documents", json={"text": "a", "owner": "x"})), 422),
        ("max_new_tokens true", lambda: H(acme.post("/v1/generate", json=gen(max_new_tokens=True))), 422),
        ("max_new_tokens string", lambda: H(acme.post("/v1/generate", json=gen(max_new_tokens="4"))), 422),
        ("max_new_tokens float", lambda: H(acme.post("/v1/generate", json=gen(max_new_tokens=4.0))), 422),
        ("max_new_tokens zero", lambda: H(acme.post("/v1/generate", json=gen(max_new_tokens=0))), 422),
        ("max_new_tokens huge", lambda: H(acme.post("/v1/generate", json=gen(max_new_tokens=10**20))), 422),
        ("documents a string", lambda: H(acme.post("/v1/generate", json=gen(documents=doc))), 422),
        ("documents numbers", lambda: H(acme.post("/v1/generate", json=gen(documents=[123]))), 422),
        ("documents malformed id", lambda: H(acme.post("/v1/generate", json=gen(documents=["../../etc"]))), 422),
        ("documents over the limit", lambda: H(acme.post("/v1/generate", json=gen(documents=[doc] * 17))), 422),
        ("documents empty", lambda: H(acme.post("/v1/generate", json=gen(documents=[]))), 422),
        ("question a number", lambda: H(acme.post("/v1/generate", json=gen(question=7))), 422),
        ("question missing", lambda: H(acme.post("/v1/generate", json={"documents": [doc]})), 422),
        ("arm null", lambda: H(acme.post("/v1/generate", json=gen(arm=None))), 422),
        ("arm unknown", lambda: H(acme.post("/v1/generate", json=gen(arm="both"))), 422),
        # invisible text
        ("text zero-width spaces", lambda: H(acme.post("/v1/documents", json={"text": "\u200b" * 50})), 422),
        ("text format characters", lambda: H(acme.post("/v1/documents", json={
            "text": "\u200e\u200f\ufeff\u2061\u2063\u180e\u00ad"})), 422),
        ("text NUL only", lambda: H(acme.post("/v1/documents", json={"text": "\x00" * 10})), 422),
        ("text blank fillers", lambda: H(acme.post("/v1/documents", json={"text": "\u3164\u2800\u3000\u00a0"})), 422),
        ("text/plain NUL only", lambda: H(acme.post("/v1/documents", content=b"\x00\x00\x00",
                                                    headers={"Content-Type": "text/plain"})), 422),
        ("text/plain invalid UTF-8", lambda: H(acme.post("/v1/documents", content=b"ok \xff\xfe bad",
                                                         headers={"Content-Type": "text/plain"})), 422),
        ("text/plain empty", lambda: H(acme.post("/v1/documents", content=b"",
                                                 headers={"Content-Type": "text/plain"})), 422),
        ("question zero-width only", lambda: H(acme.post("/v1/generate", json=gen(question="\u200b\u200c\u2060"))),
         422),
        ("question NUL only", lambda: H(acme.post("/v1/generate", json=gen(question="\x00\x00"))), 422),
        # multipart
        ("multipart undecodable text field", lambda: H(acme.post("/v1/documents", content=mp_bad_text,
                                                                 headers=mp_h)), 422),
        ("multipart invisible text field", lambda: H(acme.post("/v1/documents", content=mp_invisible,
                                                               headers=mp_h)), 422),
        ("multipart file and text", lambda: H(acme.post("/v1/documents", content=mp_both, headers=mp_h)), 422),
        ("multipart two files", lambda: H(acme.post("/v1/documents", content=mp_two_files, headers=mp_h)), 422),
        ("multipart two texts", lambda: H(acme.post("/v1/documents", content=mp_two_texts, headers=mp_h)), 422),
        ("multipart file named text", lambda: H(acme.post("/v1/documents", content=mp_file_text_name,
                                                          headers=mp_h)), 422),
        ("multipart NUL file", lambda: H(acme.post("/v1/documents", content=mp_nul_file, headers=mp_h)), 422),
        ("multipart invalid UTF-8 file", lambda: H(acme.post("/v1/documents", files={
            "file": ("d.txt", b"\xc3\x28 bad")})), 422),
        ("multipart other part", lambda: H(acme.post("/v1/documents", files={"other": ("d.txt", b"abc")})), 422),
        ("multipart no boundary", lambda: H(acme.post("/v1/documents", content=mp_both, headers={
            "Content-Type": "multipart/form-data"})), 422),
        ("multipart garbage", lambda: H(acme.post("/v1/documents", content=b"--rkboundary\r\ngarbage\r\n\r\n",
                                                  headers=mp_h)), 422),
        ("multipart without length", lambda: H(acme.post("/v1/documents", content=iter([mp_both]),
                                                         headers=mp_h)), 413),
        # sizes: never read past the limit, never echoed
        ("huge generate body", lambda: H(acme.post("/v1/generate", content=huge, headers=J)), 413),
        ("huge generate chunked", lambda: H(acme.post("/v1/generate", content=chunks(8 << 20), headers=J)), 413),
        ("huge upload", lambda: H(acme.post("/v1/documents", content=huge, headers=J)), 413),
        ("huge upload chunked", lambda: H(acme.post("/v1/documents", content=chunks(8 << 20), headers={
            "Content-Type": "text/plain"})), 413),
        ("huge multipart", lambda: H(acme.post("/v1/documents", files={"file": ("d.txt", huge)})), 413),
        ("declared 1 GB, nothing sent", lambda: raw_http(P, raw_request("POST", "/v1/generate", headers=J,
                                                                         declared=1 << 30)), 413),
        ("body on a GET", lambda: raw_http(P, raw_request("GET", "/v1/documents", b"y" * (MAX_BODY + 1))), 413),
        ("generate as text/plain", lambda: H(acme.post("/v1/generate", content=b"z" * (MAX_GENERATE - 10),
                                                       headers={"Content-Type": "text/plain"})), 422),
        ("generate long question", lambda: H(acme.post("/v1/generate", json=gen(question="w" * 16385))), 413),
        ("too many tokens", lambda: H(acme.post("/v1/documents", json={"tokens": [5] * (MAX_TOKENS + 1)})), 413),
        ("unsupported type", lambda: H(acme.post("/v1/documents", content=b"<doc/>",
                                                 headers={"Content-Type": "application/xml"})), 415),
        ("no content type", lambda: raw_http(P, raw_request("POST", "/v1/documents", b"abc")), 415),
        # auth, ids, tenants, state
        ("no token", lambda: H(anon.get("/v1/documents")), 401),
        ("no token upload", lambda: H(anon.post("/v1/documents", json={"text": "sneaky document"})), 401),
        ("wrong token", lambda: H(anon.get("/v1/documents", headers={"Authorization": "Bearer nope-nope-nope"})), 401),
        ("basic auth", lambda: H(anon.get("/v1/documents", headers={"Authorization": "Basic YWNtZTphY21l"})), 401),
        ("empty bearer", lambda: raw_http(P, raw_request("GET", "/v1/documents", headers={
            "Authorization": "Bearer "})), 401),
        ("latin-1 token", lambda: H(anon.get("/v1/documents", headers={"Authorization": b"Bearer \xff\xfe\xe9"})),
         401),
        ("token of another case", lambda: H(anon.get("/v1/documents", headers={
            "Authorization": f"Bearer {TENANTS['acme'].upper()}"})), 401),
        ("unknown id", lambda: H(acme.get(f"/v1/documents/{'0' * 32}")), 404),
        ("malformed id", lambda: H(acme.get("/v1/documents/not-an-id")), 422),
        ("bad UTF-8 id", lambda: H(acme.get("/v1/documents/%FF%FE")), 422),
        ("unknown id retire", lambda: H(acme.delete(f"/v1/documents/{'0' * 32}")), 404),
        ("retire while queued", lambda: H(acme.delete(f"/v1/documents/{doc}")), 409),
        ("unknown id generate", lambda: H(acme.post("/v1/generate", json=gen(documents=["0" * 32]))), 404),
        ("another tenant's document", lambda: H(acme.get(f"/v1/documents/{other}")), 404),
        ("another tenant's retire", lambda: H(acme.delete(f"/v1/documents/{other}")), 404),
        ("another tenant's generate", lambda: H(acme.post("/v1/generate", json=gen(documents=[other]))), 404),
        ("wrong method", lambda: H(acme.put("/v1/documents", json={"text": "a"})), 405),
        ("unknown route", lambda: H(acme.get("/v1/nothing-here")), 404),
    ]
    assert len(cases) >= 40
    before = snapshot(app)
    problems, fivexx, changed = [], 0, 0
    for name, send, want in cases:
        try:
            status, headers, body = send()
        except (httpx.HTTPError, OSError) as e:       # no answer at all (a hang past the client's timeout, a reset)
            problems.append(f"{name}: no answer: {e!r}"[:300])
            continue
        fivexx += status >= 500
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        detail = parsed.get("detail") if isinstance(parsed, dict) else None
        if status != want:
            problems.append(f"{name}: {status} (want {want}) {body[:300]!r}")
        elif not detail or not headers.get("content-type", "").startswith("application/json"):
            problems.append(f"{name}: no JSON error with a detail: {body[:300]!r}")
        elif len(body) > MAX_ERROR_BYTES:
            problems.append(f"{name}: {len(body)} bytes of error (input echoed?)")
        after = snapshot(app)
        if after != before:
            changed += 1
            problems.append(f"{name}: Redis changed: {sorted(set(after) ^ set(before)) or 'values'}")
            before = after
    for c in (acme, globex, anon):
        c.close()
    print(f"\napi hostile inputs: {len(cases)} tried, {fivexx} 5xx, {changed} state changes, "
          f"{len(problems)} problems")
    record_property("fault_counts", ("bad HTTP inputs (API)", {"tried": len(cases), "5xx": fivexx,
                                                               "state changes": changed}))
    assert not problems, "\n".join(problems)


def test_error_bodies_name_the_problem(app):
    """A few of the messages, as a caller reads them."""
    with client(app) as c:
        r = c.post("/v1/documents", content=b'{"text": "a", "text": "b"}', headers={"Content-Type": "application/json"})
        assert "duplicate key" in r.json()["detail"], r.text
        r = c.get("/v1/documents?page_token=%C2%B2")
        assert "page_token" in r.json()["detail"], r.text
        r = c.post("/v1/generate", content=b"z" * (MAX_GENERATE - 10), headers={"Content-Type": "text/plain"})
        item = r.json()["detail"][0]
        assert r.status_code == 422 and len(item["input"]) < 100, r.text      # trimmed, not 16 KB of z
        r = c.post("/v1/documents", json={"tokens": [True, False]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-2:] == ["tokens", 0], r.text
        r = c.post("/v1/documents", content=b"y" * (MAX_UPLOAD + 1), headers={"Content-Type": "text/plain"})
        assert r.status_code == 413 and r.json()["error"] == "PayloadTooLarge" and str(MAX_UPLOAD) in r.text


# ------------------------------------------------------------------------------------------- body timeout

def test_slow_body_gets_408_and_the_connection_closed(app):
    before = snapshot(app)
    body = json.dumps({"text": "a slow document that never finishes arriving"}).encode()
    req = raw_request("POST", "/v1/documents", body[:10], headers={"Content-Type": "application/json"},
                      declared=len(body))
    t0 = time.monotonic()
    status, headers, resp = raw_http(app["port"], req)        # stalls after 10 bytes
    took = time.monotonic() - t0
    assert status == 408, resp
    assert json.loads(resp)["error"] == "RequestTimeout" and headers.get("connection") == "close"
    assert BODY_TIMEOUT_S * 0.9 <= took < BODY_TIMEOUT_S + 5, took
    # a body dripped a byte at a time keeps the connection busy but still meets the deadline from its first read
    full = raw_request("POST", "/v1/documents", body, headers={"Content-Type": "application/json"})
    head, _, rest = full.partition(b"\r\n\r\n")
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", app["port"]), timeout=10) as sock:
        sock.sendall(head + b"\r\n\r\n")
        got = b""
        for i in range(len(rest)):
            try:
                sock.sendall(rest[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.2)                     # 60 bytes at 5 B/s: 12 s, far past the deadline
            sock.setblocking(False)
            try:
                got += sock.recv(65536)
            except BlockingIOError:
                pass
            sock.setblocking(True)
            if b"\r\n\r\n" in got:
                break
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert time.monotonic() - t0 < BODY_TIMEOUT_S + 3
    assert snapshot(app) == before
    with client(app) as c:      # the server still serves
        assert c.get("/v1/documents").status_code == 200


def test_slow_head_gets_408_and_a_silent_connection_is_closed(app):
    t0 = time.monotonic()
    status, headers, resp = raw_http(app["port"], b"GET /v1/documents HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    assert status == 408 and json.loads(resp)["error"] == "RequestTimeout", resp
    assert HEAD_TIMEOUT_S * 0.9 <= time.monotonic() - t0 < HEAD_TIMEOUT_S + 5
    with socket.create_connection(("127.0.0.1", app["port"]), timeout=HEAD_TIMEOUT_S + 5) as sock:
        t0 = time.monotonic()
        assert sock.recv(100) == b""                # closed without a word: it never asked anything
        assert time.monotonic() - t0 < HEAD_TIMEOUT_S + 5
    # after a response, a keep-alive connection that starts a head and stalls is closed too
    with socket.create_connection(("127.0.0.1", app["port"]), timeout=HEAD_TIMEOUT_S + 5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        first = b""
        while not first.endswith(b'{"status":"ok"}'):         # the whole response (head and body may split)
            chunk = sock.recv(65536)
            assert chunk, first
            first += chunk
        assert first.startswith(b"HTTP/1.1 200"), first
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        rest = b""
        while chunk := sock.recv(65536):
            rest += chunk
        assert rest.startswith(b"HTTP/1.1 408"), rest


# ---------------------------------------------------------------------------------------------- metrics

def test_metrics_count_every_response_by_route_template_and_status(app):
    def count(method: str, route: str, status: int) -> float:
        return scrape(app["url"]).get(
            f'redknot_api_responses_total{{method="{method}",route="{route}",status="{status}"}}', 0.0)

    keys = [("GET", "/v1/documents", 200), ("GET", "/v1/documents", 401), ("GET", "/v1/documents/{doc_id}", 404),
            ("GET", "/v1/documents/{doc_id}", 422), ("POST", "/v1/generate", 422), ("POST", "/v1/generate", 413),
            ("GET", "unmatched", 404), ("GET", "/healthz", 200)]
    before = {k: count(*k) for k in keys}
    with client(app, "counted") as c, client(app, None) as anon:
        for _ in range(2):
            assert c.get("/v1/documents").status_code == 200
        assert anon.get("/v1/documents").status_code == 401
        assert c.get(f"/v1/documents/{'1' * 32}").status_code == 404
        assert c.get(f"/v1/documents/{'2' * 32}").status_code == 404
        assert c.get("/v1/documents/nope").status_code == 422
        assert c.post("/v1/generate", json={"documents": []}).status_code == 422
        assert c.post("/v1/generate", content=b"q" * (MAX_GENERATE + 1)).status_code == 413
        assert c.get("/no/such/path/12345").status_code == 404
        assert c.get("/healthz").status_code == 200
    want = {("GET", "/v1/documents", 200): 2, ("GET", "/v1/documents", 401): 1,
            ("GET", "/v1/documents/{doc_id}", 404): 2, ("GET", "/v1/documents/{doc_id}", 422): 1,
            ("POST", "/v1/generate", 422): 1, ("POST", "/v1/generate", 413): 1, ("GET", "unmatched", 404): 1,
            ("GET", "/healthz", 200): 1}
    after = {k: count(*k) for k in keys}
    assert {k: after[k] - before[k] for k in keys} == want
    text = httpx.get(f"{app['url']}/metrics", timeout=10).text
    assert "1111111111" not in text and "/no/such/path" not in text         # templates, never raw paths
    assert 'redknot_requests_total{arm="reuse",outcome="ok"}' in text        # the generate counter is still there


# ------------------------------------------------------------------------------------------ broken records

def test_a_broken_record_is_a_409_for_that_document_and_the_listing_goes_on(app):
    r = redis.Redis.from_url(app["redis_url"])
    with client(app, "broken") as c:
        ids = [upload(c, f"Document number {i} of the broken tenant, with some words. " * 2) for i in range(4)]
        good, no_tokens, bad_field, bad_key = ids
        tokens_key = f"{app['prefix']}:tokens:{{broken/{no_tokens}}}"
        assert r.delete(tokens_key) == 1
        doc = lambda i: f"{queue_tag(app['prefix'])}:doc:broken:{i}"        # noqa: E731
        r.hset(doc(bad_field), "n_tokens", "twelve")
        r.hset(doc(bad_key), mapping={"status": "ready", "key": "{not json"})

        page = c.get("/v1/documents", params={"page_size": 10})
        assert page.status_code == 200, page.text
        p = page.json()
        assert [d["id"] for d in p["documents"]] == [good, no_tokens] and p["total"] == 4
        assert {b["id"] for b in p["broken"]} == {bad_field, bad_key}
        assert all("unreadable" in b["reason"] for b in p["broken"]), p["broken"]
        # paging still works around them
        first = c.get("/v1/documents", params={"page_size": 2}).json()
        second = c.get("/v1/documents", params={"page_size": 2, "page_token": first["next_page_token"]}).json()
        assert [d["id"] for d in first["documents"]] == [good, no_tokens] and first["broken"] == []
        assert second["documents"] == [] and len(second["broken"]) == 2 and second["next_page_token"] is None

        q = {"question": "Which document is this?", "max_new_tokens": 2}
        before = snapshot(app)
        for d in (bad_field, bad_key):
            for resp in (c.get(f"/v1/documents/{d}"), c.delete(f"/v1/documents/{d}"),
                         c.post("/v1/generate", json={"documents": [good, d], **q})):
                assert resp.status_code == 409 and resp.json()["error"] == "BrokenDocument", resp.text
                assert d in resp.json()["detail"]
        resp = c.post("/v1/generate", json={"documents": [no_tokens], **q})
        assert resp.status_code == 409 and "tokens are missing" in resp.json()["detail"], resp.text
        # uploading a broken record's content again is refused before anything is written
        resp = c.post("/v1/documents", json={"text": "Document number 2 of the broken tenant, with some words. " * 2})
        assert resp.status_code == 409, resp.text
        assert snapshot(app) == before
        assert c.get(f"/v1/documents/{good}").status_code == 200
        # the same content again restores deleted tokens (the id is their hash): then it is served again
        resp = c.post("/v1/documents", json={"text": "Document number 1 of the broken tenant, with some words. " * 2})
        assert resp.status_code == 200 and r.exists(tokens_key)
        resp = c.post("/v1/generate", json={"documents": [no_tokens], **q})
        assert resp.status_code == 503, resp.text          # past the registry: no worker runs in this test


# --------------------------------------------------------------------------------------------- Redis down

def test_redis_down_is_503_with_retry_after(tmp_path, checkpoint):
    rs, port = started_redis_service(tmp_path)
    api = None
    try:
        api, url = api_service(tmp_path / "api", checkpoint, f"redis://127.0.0.1:{port}/0", "rkdown")
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TENANTS['acme']}"}, timeout=30) as c:
            doc = upload(c, "A document uploaded while Redis was up. " * 2)
            assert rs.stop() == 0
            calls = [c.get("/v1/documents"), c.get(f"/v1/documents/{doc}"), c.delete(f"/v1/documents/{doc}"),
                     c.post("/v1/documents", json={"text": "another document"}),
                     c.post("/v1/generate", json={"documents": [doc], "question": "q?"}), c.get("/readyz")]
            for resp in calls:
                assert resp.status_code == 503, (resp.request.method, resp.request.url, resp.text)
                assert int(resp.headers["retry-after"]) >= 1
                body = resp.json()
                assert body["detail"] and str(port) not in body["detail"], body    # no host:port leaks out
            assert c.get("/healthz").status_code == 200                           # the process itself is up
            m = scrape(url)
            assert m['redknot_api_responses_total{method="GET",route="/v1/documents",status="503"}'] == 1
    finally:
        if api is not None:
            assert api.stop() == 0, api.log()
        rs.kill()


def test_connections_beyond_the_limit_get_503_and_the_api_recovers(tmp_path, checkpoint, redis_url):
    """At most `max_connections` connections (or requests in flight) at once: one more is answered 503 at once, not
    queued behind the others; once they close, requests are served again."""
    limit = 4
    svc, url = api_service(tmp_path / "api", checkpoint, redis_url, f"rkconn-{uuid.uuid4().hex[:8]}",
                           max_connections=limit)
    port = int(url.rsplit(":", 1)[1])
    held = []
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            assert c.get("/healthz").status_code == 200
        for _ in range(limit):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")        # a head not finished: the connection stays
            held.append(s)
        time.sleep(0.2)
        with httpx.Client(base_url=url, timeout=10) as c:
            assert c.get("/healthz").status_code == 503
        for s in held:
            s.close()
        held.clear()
        deadline = time.monotonic() + 10
        while True:
            with httpx.Client(base_url=url, timeout=10) as c:
                if c.get("/healthz").status_code == 200:
                    break
            assert time.monotonic() < deadline, "the API did not recover after the connections closed"
            time.sleep(0.05)
    finally:
        for s in held:
            s.close()
        svc.stop()


class StalledWorker:
    """A peer on loopback that accepts the API's worker connections and never answers (a worker stuck in a long
    forward), until `release()` closes every connection."""

    def __init__(self):
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(0.2)
        self.port = self.srv.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.srv.accept()
            except TimeoutError:
                continue
            self.conns.append(conn)

    def release(self) -> None:
        self.done.set()
        self.thread.join(5)
        for c in self.conns:
            c.close()
        self.srv.close()


def test_health_and_reads_stay_quick_with_many_generate_requests_waiting_on_the_worker(tmp_path, checkpoint,
                                                                                       redis_url):
    """50 generate requests wait on a worker that does not answer; /healthz (the liveness probe) and document reads
    answer at once: generate runs on threads of its own (REDKNOT_API_GENERATE_CONCURRENCY), /healthz on none (it
    took 17 s with 50 requests in flight on one shared pool of 40 threads)."""
    stalled = StalledWorker()
    svc, url = api_service(tmp_path / "api", checkpoint, redis_url, f"rkbusy-{uuid.uuid4().hex[:8]}",
                           worker_url=f"http://127.0.0.1:{stalled.port}", generate_timeout_s=60.0)
    headers = {"Authorization": f"Bearer {TENANTS['acme']}"}
    pool = ThreadPoolExecutor(50)
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            doc = upload(c, "A document whose generate requests wait on a stuck worker. " * 2)
        body = {"documents": [doc], "question": "What waits?", "max_new_tokens": 2}

        def one():
            with httpx.Client(base_url=url, headers=headers, timeout=90) as c:
                return c.post("/v1/generate", json=body).status_code
        waiting = [pool.submit(one) for _ in range(50)]
        deadline = time.monotonic() + 30
        while len(stalled.conns) < 40:              # the requests reached the worker and wait on it
            assert time.monotonic() < deadline, f"only {len(stalled.conns)} requests reached the worker"
            time.sleep(0.05)
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            worst = 0.0
            for _ in range(10):
                for path in ("/healthz", f"/v1/documents/{doc}", "/v1/documents", "/metrics"):
                    t = time.perf_counter()
                    assert c.get(path).status_code == 200, path
                    worst = max(worst, time.perf_counter() - t)
        assert worst < 2.0, worst                   # was 17.1 s for /healthz
        assert not any(f.done() for f in waiting)  # and the generate requests were still waiting all along
        stalled.release()                           # the worker goes away: each request gets its answer
        codes = [f.result(timeout=60) for f in waiting]
        assert set(codes) <= {502, 503}, codes
    finally:
        stalled.release()
        pool.shutdown(wait=False, cancel_futures=True)
        svc.stop()


def test_a_full_worker_queue_is_429_with_retry_after_and_takes_requests_again(tmp_path, checkpoint, redis_url):
    """A real worker (CPU, the tiny checkpoint) that holds one request waiting at most and takes 2 s per request
    (its after_fetch failpoint): of four requests at once, those beyond the queue get 429 with Retry-After at once
    through the API (busy, not down: 503 was the old answer), and a request after them is served. On the worker's
    own port a request runs only with the bearer token of its tenant (the API forwards the caller's)."""
    from services.worker.settings import WorkerSettings
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{t} {tok}\n" for t, tok in TENANTS.items()))

    def start_worker() -> tuple[Service, str]:        # its port from free_port(): again while another took it first
        port = free_port()
        ws = WorkerSettings(model=str(checkpoint), profile="demo", tokens_file=str(tokens),
                            listen=f"127.0.0.1:{port}", store=f"127.0.0.1:{free_port()}", redis_url=redis_url,
                            max_queue=1, failpoints="after_fetch=2")
        url = f"http://127.0.0.1:{port}"
        w = Service("worker", [sys.executable, "-m", "services.cli", "worker"],
                    {"PYTHONUNBUFFERED": "1", **ws.to_env()}, tmp_path / "worker.log", lambda: http_ok(url + "/readyz"))
        w.start(Path(__file__).resolve().parents[2])
        try:
            w.wait_ready(120)
        except BaseException:
            w.kill()
            raise
        return w, url
    worker, worker_url = retry_if_port_taken(start_worker)
    svc = None
    try:
        svc, url = api_service(tmp_path / "api", checkpoint, redis_url, f"rkfull-{uuid.uuid4().hex[:8]}",
                               worker_url=worker_url)
        headers = {"Authorization": f"Bearer {TENANTS['acme']}"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            doc = upload(c, "A short document for a busy worker. " * 2)
        body = {"documents": [doc], "question": "Who is busy?", "max_new_tokens": 1, "arm": "recompute"}

        def one():
            with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
                r = c.post("/v1/generate", json=body)
                return r.status_code, r.headers.get("Retry-After"), r.json()
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(one) for _ in range(4)]
            saturated = []                  # readiness while the queue is full: 503 "saturated", on both sides
            deadline = time.monotonic() + 4.0
            while not saturated and time.monotonic() < deadline:
                w = httpx.get(worker_url + "/readyz", timeout=5)
                if w.status_code == 503:
                    saturated = [w.json(), httpx.get(url + "/readyz", timeout=5)]
                time.sleep(0.05)
            got = [f.result() for f in futures]
        assert saturated and saturated[0] == {"status": "saturated", "waiting": 1, "capacity": 1}, saturated
        assert saturated[1].status_code == 503 and "saturated" in saturated[1].json()["detail"]
        codes = sorted(code for code, _, _ in got)
        assert codes.count(429) >= 2 and codes.count(200) >= 1 and set(codes) <= {200, 429}, got
        busy = [(after, body) for code, after, body in got if code == 429]
        assert all(after == "1" and b["error"] == "Busy" and "already waiting" in b["detail"] for after, b in busy)
        code, _, out = one()                               # the queue drained: served again
        assert code == 200 and out["arm"] == "recompute"
        assert httpx.get(worker_url + "/readyz", timeout=5).json()["status"] == "ready"
        # the worker's own port: nothing runs without the bearer token of the request's tenant
        direct = {"tenant": "acme", "documents": [{"id": "d", "tokens": [5, 6, 7], "generation": 0}],
                  "question": [8, 9], "max_new_tokens": 1, "arm": "recompute"}
        with httpx.Client(base_url=worker_url, timeout=60) as w:
            assert w.post("/v1/generate", json=direct).status_code == 401
            for who in ("globex", "acme"):
                r = w.post("/v1/generate", json=direct, headers={"Authorization": f"Bearer {TENANTS[who]}"})
                assert r.status_code == (200 if who == "acme" else 401), (who, r.text)
    finally:
        if svc is not None:
            svc.stop()
        worker.stop()


def test_the_api_serves_its_openapi_document_and_no_cdn_backed_pages(app):
    """/openapi.json is served; /docs and /redoc are not (their pages load scripts from a CDN: blank offline)."""
    with httpx.Client(base_url=app["url"], timeout=30) as c:
        doc = c.get("/openapi.json")
        assert doc.status_code == 200 and doc.json()["info"]["title"] == "RedKnot-MLA artifact API"
        assert "/v1/generate" in doc.json()["paths"]
        for page in ("/docs", "/redoc"):
            assert c.get(page).status_code == 404, page


def test_the_api_refuses_to_start_without_a_document_id_key():
    for bad in ("", "zz" * 32, "ab" * 16):
        with pytest.raises(SystemExit, match="64 hex digits"):
            ApiSettings(id_secret=bad).document_id_secret()
    assert ApiSettings(id_secret=ID_SECRET).document_id_secret() == bytes.fromhex(ID_SECRET)
