"""Just enough PromQL reading to say which metric names, label names and label values an expression uses.

Not a parser: a tokenizer that knows PromQL's functions, aggregations and keywords, so every other identifier
is a metric name. Grafana variables ($__rate_interval, ${datasource}) become a plain duration first."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

AGGREGATIONS = {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
                "count_values", "group", "limitk", "limit_ratio"}
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "avg_over_time",
    "ceil", "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh", "count_over_time", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "deg", "delta", "deriv", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev", "histogram_stdvar",
    "histogram_sum", "holt_winters", "double_exponential_smoothing", "hour", "idelta", "increase", "irate",
    "label_join", "label_replace", "last_over_time", "ln", "log10", "log2", "mad_over_time", "max_over_time",
    "min_over_time", "minute", "month", "pi", "predict_linear", "present_over_time", "quantile_over_time", "rad",
    "rate", "resets", "round", "scalar", "sgn", "sin", "sinh", "sort", "sort_by_label", "sort_by_label_desc",
    "sort_desc", "sqrt", "stddev_over_time", "stdvar_over_time", "sum_over_time", "tan", "tanh", "time",
    "timestamp", "vector", "year"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"} | GROUPING

_TOKEN = re.compile(r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')
  | (?P<range>\[[^\]]*\])
  | (?P<matchers>\{[^}]*\})
  | (?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?:ms|[smhdwy])?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<other>\S)""", re.VERBOSE)
_MATCHER = re.compile(r"""\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<op>=~|!~|!=|=)\s*
                          (?P<value>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')\s*,?""", re.VERBOSE)
_GRAFANA_VARS = re.compile(r"\$__\w+|\$\{[^}]+\}|\$\w+")


@dataclass
class Selector:
    metric: str
    matchers: list[tuple[str, str, str]] = field(default_factory=list)     # (label, op, value)


@dataclass
class Usage:
    selectors: list[Selector] = field(default_factory=list)
    grouping_labels: set[str] = field(default_factory=set)                 # by (...), on (...), ...


def _matchers(block: str) -> list[tuple[str, str, str]]:
    inner, out, pos = block[1:-1], [], 0
    while inner[pos:].strip():
        m = _MATCHER.match(inner, pos)
        assert m, f"cannot read label matchers {block!r}"
        out.append((m["label"], m["op"], m["value"][1:-1]))
        pos = m.end()
    return out


def usage(expr: str) -> Usage:
    expr = _GRAFANA_VARS.sub("5m", expr)
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr)]
    out, i = Usage(), 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else (None, None)
        if kind == "ident" and text in GROUPING and nxt[1] == "(":
            i += 2
            while i < len(tokens) and tokens[i][1] != ")":
                if tokens[i][0] == "ident":
                    out.grouping_labels.add(tokens[i][1])
                i += 1
        elif kind == "ident" and (text in AGGREGATIONS or text in KEYWORDS or
                                  (text in FUNCTIONS and nxt[1] == "(")):
            pass
        elif kind == "ident":
            out.selectors.append(Selector(text, _matchers(nxt[1]) if nxt[0] == "matchers" else []))
            i += nxt[0] == "matchers"
        elif kind == "matchers":                   # a selector without a metric name: {__name__=...}
            raise AssertionError(f"selector without a metric name in {expr!r}")
        i += 1
    return out
