"""The house's structure, read from the source with `ast` (nothing is imported): runtime/ imports nothing from
services/, neither package has an import circle (imports inside functions count: a circle hidden in a function is
still a circle), no runtime file but the model file exceeds 600 lines, the store's server side imports no runtime,
and docs/ holds prose only, at most 10 files."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILE = "runtime/model/deepseek_v4.py"
MAX_LINES = 600
# the store's server side: what `redknot store` runs (the client side, client.py and local_client.py, may use runtime)
STORE_SERVER = ("core", "grpc_service", "server", "index", "keys", "blob", "blob_fs", "blob_s3", "local_server",
                "local_wire", "auth", "settings", "errors", "wire", "calibration")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(package: str) -> dict[str, Path]:
    return {_module(p): p for p in sorted((ROOT / package).rglob("*.py")) if "/pb/" not in p.as_posix()}


def _imports(path: Path, module: str) -> set:
    """Every import anywhere in the file, relative ones resolved: a module name (`import m`), or for
    `from pkg import name` the pair (pkg, pkg.name): the dependency is pkg.name where that is a module, else pkg."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_pkg else anchor[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.update((base, f"{base}.{a.name}") for a in node.names)
    return out


def _flat(names: set) -> set[str]:
    return {n for x in names for n in (x if isinstance(x, tuple) else (x,))}


def _graph(package: str) -> dict[str, set[str]]:
    src = _sources(package)
    graph = {}
    for mod, path in src.items():
        deps = set()
        for name in _imports(path, mod):
            if isinstance(name, tuple):
                name = name[1] if name[1] in src else name[0]
            # the longest known module the name falls in
            while name and name not in src:
                name = name.rpartition(".")[0]
            if name and name != mod:
                deps.add(name)
        graph[mod] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph.get(w, ())))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_runtime_imports_nothing_from_services():
    bad = {mod: sorted(n for n in _flat(_imports(p, mod)) if n == "services" or n.startswith("services."))
           for mod, p in _sources("runtime").items()}
    assert {m: v for m, v in bad.items() if v} == {}


@pytest.mark.parametrize("package", ["runtime", "services"])
def test_no_import_circles(package):
    assert _cycles(_graph(package)) == []


def test_the_store_server_imports_no_runtime():
    src = _sources("services")
    bad = {}
    for name in STORE_SERVER:
        mod = f"services.store.{name}"
        if mod in src:
            hits = sorted(n for n in _flat(_imports(src[mod], mod)) if n == "runtime" or n.startswith("runtime."))
            if hits:
                bad[mod] = hits
    assert bad == {}


def test_no_runtime_file_over_the_limit():
    long = {p.relative_to(ROOT).as_posix(): n for p in (ROOT / "runtime").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES and p.relative_to(ROOT).as_posix() != MODEL_FILE}
    assert long == {}


def test_docs_hold_prose_only():
    files = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*") if p.is_file())
    assert len(files) <= 10, files
    assert [f for f in files if not f.endswith(".md")] == []


def test_the_probe_sees_a_circle():
    """The cycle finder itself: a two-module circle and a three-module one are found, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
