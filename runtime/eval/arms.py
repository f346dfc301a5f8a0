"""The harness's arms, named by spec strings, so one run compares reuse-profile variants side by side on the
same questions:

  recompute | prefix-only | naive | reuse@B[:knob=value]...

B is a fraction (0.25) or a percentage (25%). Knobs, with the eval profile's values as defaults:
  fences=F+L        first and last fence layers (--fences, 3+3)
  gpg=N             Global heads per KV group (1)
  ffn=skip|native   FFN of non-active rows in reusable layers (skip)
  lastkv=recompute|artifact   non-active rows' K/V in the last fences: recomputed from their hidden states,
                    or the artifact's (recompute)
  select=attention|mixed|deviation   row selection: the rows the question attends to most in a draft pass
                    over the artifacts (the engine's stand-in for DeepSeek's indexer picks), the shared
                    controller (dirty rows, joins, recent rows, deviation), or the top rows by first-fence
                    deviation only, CacheBlend-style (attention: on SmolLM2 it cut the first-token KL 2-4x
                    against mixed at the same budget, docs/QUALITY.md "Row selection")
  signal=k|kv       the deviation measured on K, or on K and V (k)
  join=N            join rows at each end of a relocated segment (16)
  recent=N          most recent request rows protected (64)
  sink=N            each relocated document's first N rows active first, inside the budget (0)
  slope=S           budgets per layer: from B x (1 + S) at the first reusable layer to B x (1 - S) at the
                    last, nested (0: B at every layer)
  local=native|fp8  the stored Local contribution W_o,L O_L: the model's dtype, or e4m3 codes with a power-of-two
                    scale per row and 128 channels, dequantized where the engine restores it (native)
An arm's name is its canonical spec (`reuse@25%:ffn=native`); knobs left at their defaults are not named, so
`reuse@0.25:ffn=skip` is the default arm `reuse@25%`."""
from __future__ import annotations

from dataclasses import dataclass

from runtime.reuse.profile import DEVIATION_SIGNALS, LAST_FENCE_KV, LOCAL_FORMATS, SELECT_RULES, ReuseProfile

BASELINES = ("recompute", "prefix-only", "naive")
JOIN_ROWS, RECENT_ROWS = 16, 64


class ArmError(ValueError):
    """An arm spec that does not parse; the command reports it before any model is loaded."""


def _fences(v: str) -> tuple[int, int]:
    a, _, b = v.partition("+")
    return int(a), int(b)


# knob -> (profile field, parser that raises ValueError)
KNOBS = {
    "fences": ("fences", _fences),
    "gpg": ("global_per_group", int),
    "ffn": ("ffn_mode", lambda v: _choice(v, ("skip", "native"))),
    "lastkv": ("last_fence_kv", lambda v: _choice(v, LAST_FENCE_KV)),
    "select": ("select", lambda v: _choice(v, SELECT_RULES)),
    "signal": ("signal", lambda v: _choice(v, DEVIATION_SIGNALS)),
    "join": ("join_rows", int),
    "recent": ("recent_rows", int),
    "sink": ("sink_rows", int),
    "slope": ("budget_slope", float),
    "local": ("local_format", lambda v: _choice(v, LOCAL_FORMATS)),
}
DEFAULTS = {"gpg": "1", "ffn": "skip", "lastkv": "recompute", "select": "attention", "signal": "k",
            "join": str(JOIN_ROWS), "recent": str(RECENT_ROWS), "sink": "0",
            "slope": "0", "local": "native"}


def _choice(v: str, allowed: tuple[str, ...]) -> str:
    if v not in allowed:
        raise ArmError(f"{v!r} not in {allowed}")
    return v


@dataclass(frozen=True)
class Arm:
    kind: str                                   # recompute, prefix-only, naive or reuse
    budget: float | None = None
    knobs: tuple[tuple[str, str], ...] = ()     # (knob, value), sorted, defaults dropped

    @property
    def name(self) -> str:
        if self.kind != "reuse":
            return self.kind
        return f"reuse@{self.budget * 100:g}%" + "".join(f":{k}={v}" for k, v in self.knobs)

    def profile(self, base: ReuseProfile) -> ReuseProfile:
        """The base profile with this arm's budget and profile knobs (naive runs at the base budget)."""
        kw = {} if self.budget is None else {"budget": self.budget}
        for k, v in self.knobs:
            field, parse = KNOBS[k]
            if field == "fences":
                kw["first_fences"], kw["last_fences"] = parse(v)
            else:
                kw[field] = parse(v)
        return base.replace(**kw)


def parse_arm(spec: str, fences: tuple[int, int] = (3, 3)) -> Arm:
    """One arm spec; `fences` is the run's default, so `fences=3+3` on a 3+3 run names the default arm."""
    spec = spec.strip()
    if spec in BASELINES:
        return Arm(spec)
    head, *opts = spec.split(":")
    if not head.startswith("reuse@"):
        raise ArmError(f"arm {spec!r}: expected one of {BASELINES} or reuse@BUDGET[:knob=value]...")
    b = head.removeprefix("reuse@")
    try:
        budget = float(b[:-1]) / 100 if b.endswith("%") else float(b)
    except ValueError:
        raise ArmError(f"arm {spec!r}: budget {b!r} is not a number") from None
    if not 0 < budget <= 1:
        raise ArmError(f"arm {spec!r}: budget {budget} not in (0, 1]")
    defaults = dict(DEFAULTS, fences=f"{fences[0]}+{fences[1]}")
    knobs = {}
    for o in opts:
        k, eq, v = o.partition("=")
        if not eq or k not in KNOBS:
            raise ArmError(f"arm {spec!r}: {o!r} is not knob=value with a knob in {sorted(KNOBS)}")
        try:
            KNOBS[k][1](v)
        except ValueError as e:
            raise ArmError(f"arm {spec!r}: {k}={v!r}: {e}") from None
        if k in knobs:
            raise ArmError(f"arm {spec!r}: {k} given twice")
        knobs[k] = v
    return Arm("reuse", budget, tuple(sorted((k, v) for k, v in knobs.items() if v != defaults[k])))


def default_arms(budgets: list[float]) -> list[Arm]:
    """What the issue asks for: the three baselines and the reuse arm at each budget."""
    return [Arm(b) for b in BASELINES] + [Arm("reuse", b) for b in budgets]


def arm_list(budgets: list[float], variants: list[str], fences: tuple[int, int] = (3, 3)) -> list[Arm]:
    """The default arms, then the variants (a variant equal to a default arm or to another variant is an
    error: it would run twice under one name)."""
    arms = default_arms(budgets) + [parse_arm(v, fences) for v in variants]
    names = [a.name for a in arms]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ArmError(f"arms {dup} given twice (knobs at their defaults are not part of a name)")
    return arms
