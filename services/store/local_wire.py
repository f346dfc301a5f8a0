"""Frames of the local socket (local_server.py, local_client.py): co-located readers get open blob descriptors.

The socket is AF_UNIX SOCK_SEQPACKET: the kernel keeps each frame whole and carries its length, and the file
descriptors of a reply (SCM_RIGHTS) travel inside the frame they belong to. A frame is one msgpack map of at
most MAX_FRAME bytes; a longer one is refused unread (the kernel drops its rest), so nothing is unbounded.

    request  {"v": 1, "op": "fetch" | "report", "token": str, "key": [doc_hash, checkpoint, profile, tp_size],
              "generation": int, "rank": int, "layers": [lo, hi] | nil, "channels": [lo, hi] | nil,
              "names": [str, ...]}
    fetch    -> {"generation": int, "shards": [ShardSpec.to_list(), ...], "last": bool} with one descriptor per
                shard, in order, at most BATCH a frame, until "last"
    report   -> {"confirmed": bool}    (a reader found the one named shard corrupt; the server re-hashes it)
    error    -> {"error": "NotFound" | "InvalidArgument" | ..., "detail": str}   (an errors.py class name)

The request carries the same fields and the same bearer token as FetchShards and is resolved by the same core
call (`ArtifactStore.select`), so authorization and selection exist once."""
from __future__ import annotations

import socket
from dataclasses import dataclass

import msgpack

from . import errors
from .core import FetchParams
from .errors import InvalidArgument, LimitExceeded, StoreError
from .keys import DocumentKey, Range, ShardSpec

VERSION = 1
MAX_FRAME = 64 << 10
BATCH = 32                  # shards (descriptors) per reply frame; Linux passes at most 253 per message
OPS = ("fetch", "report")
_ERRORS = {cls.__name__: cls for cls in errors.GRPC_CODE}


@dataclass(frozen=True)
class Request:
    op: str
    token: str
    params: FetchParams


def pack(frame: dict) -> bytes:
    raw = msgpack.packb(frame, use_bin_type=True)
    if len(raw) > MAX_FRAME:
        raise LimitExceeded(f"a local socket frame of {len(raw)} bytes exceeds {MAX_FRAME} (name fewer shards)")
    return raw


def _range(v) -> Range | None:
    if v is None:
        return None
    if not (isinstance(v, list) and len(v) == 2):
        raise InvalidArgument(f"range {v!r} is not [lo, hi]")
    return Range(*v)


def request_bytes(op: str, token: str, p: FetchParams) -> bytes:
    k = p.key
    return pack({"v": VERSION, "op": op, "token": token,
                 "key": [k.doc_hash, k.checkpoint_fingerprint, k.profile, k.tp_size], "generation": p.generation,
                 "rank": p.rank, "layers": None if p.layers is None else [p.layers.lo, p.layers.hi],
                 "channels": None if p.channels is None else [p.channels.lo, p.channels.hi], "names": list(p.names)})


def parse_request(raw: bytes) -> Request:
    """A request frame, checked for shape; the values are checked by the core like any FetchShards request."""
    try:
        d = msgpack.unpackb(raw, raw=False)
    except Exception as e:          # noqa: BLE001 - msgpack raises several types for bad bytes
        raise InvalidArgument(f"frame is not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(d, dict):
        raise InvalidArgument(f"frame is a {type(d).__name__}, not a map")
    if d.get("v") != VERSION:
        raise InvalidArgument(f"protocol version {d.get('v')!r}, this server speaks {VERSION}")
    if d.get("op") not in OPS:
        raise InvalidArgument(f"op {d.get('op')!r} is not one of {OPS}")
    key, names = d.get("key"), d.get("names", [])
    if not (isinstance(key, list) and len(key) == 4):
        raise InvalidArgument("key is not [doc_hash, checkpoint_fingerprint, profile, tp_size]")
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise InvalidArgument("names is not a list of strings")
    token = d.get("token")
    if not isinstance(token, str):
        raise InvalidArgument("token is not a string")
    for field_ in ("generation", "rank"):
        if not isinstance(d.get(field_), int) or isinstance(d.get(field_), bool):
            raise InvalidArgument(f"{field_} {d.get(field_)!r} is not an integer")
    params = FetchParams(DocumentKey(*key), d["generation"], d["rank"], _range(d.get("layers")),
                         _range(d.get("channels")), tuple(names))
    return Request(d["op"], token, params)


def error_bytes(err: StoreError) -> bytes:
    name = next((c.__name__ for c in type(err).__mro__ if c.__name__ in _ERRORS), "StoreError")
    return pack({"error": name, "detail": str(err)[:4096]})


def raise_if_error(d: dict) -> dict:
    """The reply map, or its error raised as the domain error the gRPC client would raise."""
    if "error" in d:
        raise _ERRORS.get(d["error"], StoreError)(str(d.get("detail", "")))
    return d


def unpack_reply(raw: bytes) -> dict:
    d = msgpack.unpackb(raw, raw=False)
    if not isinstance(d, dict):
        raise StoreError(f"local socket reply is a {type(d).__name__}, not a map")
    return raise_if_error(d)


def shards_of(d: dict) -> list[ShardSpec]:
    return [ShardSpec.from_list(v) for v in d["shards"]]


def new_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
