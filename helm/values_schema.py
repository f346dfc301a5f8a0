#!/usr/bin/env python3
"""Generate a chart's values.schema.json from its values.yaml (the vLLM production-stack habit, without a plugin).

values.yaml is the single source: every key carries a `# --` description (helm-docs style; following `#` lines
continue it) and may carry a `# @schema {...}` line of JSON-schema keywords in YAML flow style, e.g.
`# @schema {enum: [fs, s3]}`. Types and defaults come from the values themselves. Maps are closed
(`additionalProperties: false`, so a misspelt key fails `helm lint`/`install`) unless empty or marked
`{freeform: true}`, whose contents are Kubernetes objects passed through (resources, nodeSelector...).

    python helm/values_schema.py helm/redknot          # rewrite helm/redknot/values.schema.json
    python helm/values_schema.py helm/redknot --check  # exit 1 when the committed file is stale

A value (a leaf, or a map passed through whole) without a `# --` description is an error; a group of values
may have one."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.\-/]+|\"[^\"]+\"):(?:\s|$)")
_DESC = re.compile(r"^ *# -- ?(?P<text>.*)$")
_SCHEMA = re.compile(r"^ *# @schema (?P<text>.*)$")
_CONT = re.compile(r"^ *#(?: (?P<text>.*))?$")


class UndocumentedValue(ValueError):
    """A key of values.yaml has no `# --` description."""


def _lookup(data, path: tuple[str, ...]) -> bool:
    node = data
    for k in path:
        if not isinstance(node, dict) or k not in node:
            return False
        node = node[k]
    return True


def parse_comments(text: str, data: dict) -> dict[tuple[str, ...], dict]:
    """Description and @schema keywords of every key path of `data`, read from the comment lines above it."""
    meta: dict[tuple[str, ...], dict] = {}
    stack: list[tuple[int, str]] = []            # (indent, key) of the open maps
    desc: list[str] | None = None
    schema: dict = {}
    for line in text.splitlines():
        if not line.strip():
            desc, schema = None, {}
            continue
        if m := _DESC.match(line):
            desc, schema = [m["text"].strip()], {}
            continue
        if m := _SCHEMA.match(line):
            extra = yaml.safe_load(m["text"])
            assert isinstance(extra, dict), f"@schema needs a YAML flow mapping: {line.strip()!r}"
            schema.update(extra)
            continue
        if m := _CONT.match(line):
            if desc is not None and not schema and m["text"]:
                desc.append(m["text"].strip())
            continue
        m = _KEY.match(line)
        if m is None or line.lstrip().startswith("-"):
            desc, schema = None, {}              # list items and their contents: part of a value, not keys
            continue
        indent, key = len(m["indent"]), m["key"].strip('"')
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = tuple(k for _, k in stack) + (key,)
        if _lookup(data, path):
            meta[path] = {"description": " ".join(desc) if desc else None, "schema": schema}
            stack.append((indent, key))
        desc, schema = None, {}
    return meta


def _type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    if value is None:
        return "null"
    raise TypeError(f"unsupported value {value!r}")


def _node(value, path: tuple[str, ...], meta: dict) -> dict:
    m = meta.get(path) or {"description": None, "schema": {}}
    keywords = dict(m["schema"])
    freeform = keywords.pop("freeform", False)
    out: dict = {"description": m["description"]} if m["description"] else {}
    out["type"] = _type(value)
    if isinstance(value, dict) and value and not freeform:      # a group of values: its keys are documented
        out["additionalProperties"] = False
        out["properties"] = {k: _node(v, path + (k,), meta) for k, v in value.items()}
    else:                                                         # a value: documented, with its default
        if not m["description"]:
            raise UndocumentedValue(f"{'.'.join(path)} has no `# --` description in values.yaml")
        out["default"] = value
    out.update(keywords)
    return out


def generate(chart_dir: Path) -> str:
    text = (chart_dir / "values.yaml").read_text()
    data = yaml.safe_load(text)
    meta = parse_comments(text, data)
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": f"Values of the {yaml.safe_load((chart_dir / 'Chart.yaml').read_text())['name']} chart",
        "description": "Generated from values.yaml by helm/values_schema.py: edit values.yaml, then regenerate.",
        "type": "object",
        "additionalProperties": False,
        "properties": {k: _node(v, (k,), meta) for k, v in data.items()},
    }
    schema["properties"]["global"] = {"description": "Helm's global values (when this chart is a subchart).",
                                      "type": "object"}
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str]) -> int:
    chart = Path(argv[1]) if len(argv) > 1 else Path(__file__).parent / "redknot"
    out = chart / "values.schema.json"
    text = generate(chart)
    if "--check" in argv:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is stale: run python helm/values_schema.py {chart}")
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
