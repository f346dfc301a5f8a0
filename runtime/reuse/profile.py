"""Reuse profiles: frozen values that go into every certificate.

Roles are per output group: in each group of `heads_per_group` heads the first `global_per_group` heads are
Global (computed online), the rest Local (restored from the artifact). The first and last `fences` layers
always run full recomputation with native top-k routing."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from runtime.model.config import ModelConfig

FFN_MODES = ("skip", "shared-expert-only", "native")
LAST_FENCE_KV = ("recompute", "artifact")
LOCAL_FORMATS = ("native", "fp8")
# how the budget is spent (controller.choose): "mixed" = the controller's protected classes (dirty, joins, the
# native indexer's picks where the model has one, recent rows); "deviation" = the rows whose first-fence K/V moved
# most (CacheBlend); "attention" = the rows the question attends to most in a draft pass over the artifacts
SELECT_RULES = ("mixed", "deviation", "attention")
# what the first fences' deviation is measured on: K, or K and V (DeepSeek's latent is both: the same signal)
DEVIATION_SIGNALS = ("k", "kv")
# the rule every profile ran before `select` and `signal` were profile values (`to_dict` leaves them out)
PRE_SELECTION_DEFAULTS = {"select": "mixed", "signal": "k"}


class ProfileError(ValueError):
    """A profile that cannot run on this model; the request falls back or the build is refused."""


@dataclass(frozen=True)
class ReuseProfile:
    name: str = "custom"
    first_fences: int = 3
    last_fences: int = 3
    global_per_group: int = 1
    budget: float = 0.25          # active rows as a fraction of candidate (relocated) rows
    tau: float = 0.9              # adaptive MoE fanout threshold on active rows in reusable layers
    min_experts: int = 3
    ffn_mode: str = "skip"        # FFN of non-active rows in reusable layers
    last_fence_kv: str = "recompute"
    # CSA layers, Global heads of non-active rows: "online" = the native indexer over every segment;
    # "artifact" = the document's own offline top-k picks (no online indexer for those rows)
    global_picks: str = "online"
    join_rows: int = 128          # B128: first/last rows of every relocated segment
    recent_rows: int = 32768      # T_32K
    align: int = 128              # segment starts padded to multiples of this
    # the stored Local contribution W_a,L O_L: "native" = the model's dtype; "fp8" = e4m3 codes with one power-of-two
    # scale per row and 128 channels (half the bytes of bf16), dequantized on the device in the restore
    local_format: str = "native"
    select: str = "mixed"         # SELECT_RULES: which rule spends the budget
    signal: str = "k"             # DEVIATION_SIGNALS
    # the first rows of every relocated document, chosen active before the rule spends the rest of the budget: a
    # document computed alone opened its own context (its first row is an attention sink there), not in a request
    sink_rows: int = 0
    # a fixed deployment-wide preamble (token ids) every document is built after, and every request opens with: a
    # document's artifact then holds its rows as computed after the preamble (not as if it opened the context);
    # the preamble's own artifact is itself, computed alone. The Llama family; bound by certificates when set
    preamble: tuple[int, ...] = ()
    # budgets per layer: the active fraction falls linearly over the reusable layers, from budget x (1 + slope) at
    # the first to budget x (1 - slope) at the last (mean: the budget); each layer's active rows are the first of
    # the rule's order (`controller.fill_order`), so a row drops out for good. The Llama family; 0: one budget
    budget_slope: float = 0.0

    def __post_init__(self):
        if not 0.0 < self.budget <= 1.0:
            raise ProfileError(f"budget={self.budget} must be in (0, 1]")
        if not 0.0 < self.tau <= 1.0:
            raise ProfileError(f"tau={self.tau} must be in (0, 1]")
        if self.ffn_mode not in FFN_MODES:
            raise ProfileError(f"ffn_mode={self.ffn_mode!r} not in {FFN_MODES}")
        if self.last_fence_kv not in LAST_FENCE_KV:
            raise ProfileError(f"last_fence_kv={self.last_fence_kv!r} not in {LAST_FENCE_KV}")
        if self.local_format not in LOCAL_FORMATS:
            raise ProfileError(f"local_format={self.local_format!r} not in {LOCAL_FORMATS}")
        if self.select not in SELECT_RULES:
            raise ProfileError(f"select={self.select!r} not in {SELECT_RULES}")
        if self.signal not in DEVIATION_SIGNALS:
            raise ProfileError(f"signal={self.signal!r} not in {DEVIATION_SIGNALS}")
        if self.global_picks not in ("online", "artifact"):
            raise ProfileError(f"global_picks={self.global_picks!r} not in ('online', 'artifact')")
        if self.first_fences < 1:
            raise ProfileError("at least one first fence is needed: it yields the dirty-row signal")
        if self.sink_rows < 0:
            raise ProfileError(f"sink_rows={self.sink_rows} must be >= 0")
        if not 0.0 <= self.budget_slope < 1.0:
            raise ProfileError(f"budget_slope={self.budget_slope} must be in [0, 1)")
        if self.budget * (1 + self.budget_slope) > 1.0 + 1e-9:
            raise ProfileError(f"budget={self.budget} with budget_slope={self.budget_slope}: the first reusable "
                               f"layer would need {self.budget * (1 + self.budget_slope):.3g} of the rows (> 1)")
        if not isinstance(self.preamble, tuple):            # from a JSON list (to_dict, a profile file)
            object.__setattr__(self, "preamble", tuple(int(t) for t in self.preamble))

    def check(self, cfg: ModelConfig) -> None:
        if self.preamble:
            raise ProfileError("a preamble is implemented on the Llama family only")
        if self.budget_slope:
            raise ProfileError("budgets per layer (budget_slope) are implemented on the Llama family only")
        if self.first_fences + self.last_fences > cfg.n_layers:
            raise ProfileError(f"{self.first_fences}+{self.last_fences} fences exceed {cfg.n_layers} layers")
        if not 1 <= self.global_per_group <= cfg.heads_per_group:
            raise ProfileError(f"global_per_group={self.global_per_group} not in 1..{cfg.heads_per_group}")
        if self.align % max(r for r in cfg.compress_ratios + (1,)) and self.align % 4:
            raise ProfileError(f"align={self.align} must keep compression blocks aligned")
        for r in cfg.compress_ratios:
            if r and self.align % r:
                raise ProfileError(f"align={self.align} is not a multiple of compress ratio {r}")

    def is_fence(self, cfg: ModelConfig, layer: int) -> bool:
        return layer < self.first_fences or layer >= cfg.n_layers - self.last_fences

    def reusable_layers(self, cfg: ModelConfig) -> list[int]:
        return [i for i in range(cfg.n_layers) if not self.is_fence(cfg, i)]

    def layer_budget(self, k: int, n_reusable: int) -> float:
        """The budget of the k-th of `n_reusable` reusable layers (0-based): `budget` at every layer without a
        slope, else linear from budget x (1 + slope) to budget x (1 - slope)."""
        if not self.budget_slope or n_reusable < 2:
            return self.budget
        return self.budget * (1 + self.budget_slope * (1 - 2 * k / (n_reusable - 1)))

    def local_heads(self, cfg: ModelConfig) -> int:
        return cfg.n_heads - self.global_per_group * cfg.o_groups

    def structural_ceiling(self, cfg: ModelConfig) -> float:
        """(R/L) x (Local/heads): the fraction of layer x head units eligible for restoration."""
        return len(self.reusable_layers(cfg)) / cfg.n_layers * self.local_heads(cfg) / cfg.n_heads

    def to_dict(self) -> dict:
        """Every setting, as certificates and store keys bind them; the row-selection settings only where they are
        not the defaults, so what was certified before they existed (the default rule) still matches."""
        d = dataclasses.asdict(self)
        for k in ("select", "signal"):
            if d[k] == PRE_SELECTION_DEFAULTS[k]:
                del d[k]
        for k in ("sink_rows", "preamble", "budget_slope"):
            if not d[k]:
                del d[k]
            elif k == "preamble":
                d[k] = list(d[k])
        return d

    def replace(self, **kw) -> "ReuseProfile":
        return dataclasses.replace(self, **kw)


# The presets store the Local contribution in FP8: half the served bytes (9.2 KiB per document token and reusable
# layer on Flash, from 18.1 in bf16) for a first-token KL of 3-4% of reuse's own on the Flash-shaped model
# (docs/BENCHMARKS.md, bench/fp8_local.py)
FLASH_PROFILE = ReuseProfile(name="flash", local_format="fp8")  # 3F-37R-3F, 56 Local / 8 Global on Flash
PRO_PROFILE = ReuseProfile(name="pro", local_format="fp8")      # 3F-55R-3F, 112 Local / 16 Global on Pro
# the demo model has 8 layers: two fences at each end leave four reusable layers
DEMO_PROFILE = ReuseProfile(name="demo", first_fences=2, last_fences=2, budget=0.25)
# the Llama family (SmolLM2-135M, `make demo`): no compression blocks (align 1), join/recent rows scaled to
# paragraph-sized documents, the `attention` rule, and the 50% budget: the operating point docs/QUALITY.md's levers
# table chose (at 25% every lever lost 0.14-0.17 F1 on kv_retrieval; at 50% three of four tasks meet the bound)
LLAMA_PROFILE = ReuseProfile(name="llama", first_fences=3, last_fences=3, align=1, join_rows=16, recent_rows=64,
                             budget=0.5, select="attention", signal="k")
PROFILES = {"demo": DEMO_PROFILE, "flash": FLASH_PROFILE, "pro": PRO_PROFILE, "llama": LLAMA_PROFILE}


def load_profile(spec: str) -> ReuseProfile:
    """A preset name (`PROFILES`) or a JSON object of ReuseProfile fields."""
    spec = spec.strip()
    if spec in PROFILES:
        return PROFILES[spec]
    if not spec.startswith("{"):
        raise ValueError(f"profile {spec!r} is neither a preset ({', '.join(PROFILES)}) nor a JSON object")
    return ReuseProfile(**json.loads(spec))


def degenerate(cfg: ModelConfig) -> ReuseProfile:
    """Budget 100%, every head Global, native top-6: must reproduce full recomputation."""
    return ReuseProfile(name="degenerate", global_per_group=cfg.heads_per_group, budget=1.0, tau=1.0,
                        min_experts=cfg.n_activated_experts, ffn_mode="native")
