"""The four savings namespaces of SPEC §7, per request, never mixed:
1. logical head-row saving: share of (layer x head x candidate row) units not computed online;
2. physical token-row saving: share of (layer x candidate row) units whose FFN and full attention were skipped;
3. analytic FLOP saving per major operator (projections, attention, indexer, MoE) against the recompute arm;
4. measured wall-clock (TTFT per arm), filled in by whoever times the request.
Candidate rows are the relocated documents' rows; prefix rows are reused exactly and counted apart."""
from __future__ import annotations

from dataclasses import dataclass, field

from runtime.model.config import CSA, ModelConfig
from runtime.model.deepseek_v4 import prefill_out_rows
from runtime.model.flops import layer_flops
from .profile import ReuseProfile

OPS = ("projections", "attention", "indexer", "moe")


@dataclass(kw_only=True)
class RowLedger:
    """The row namespaces (1 and 2) and row counts every model family's ledger keeps the same way; each family's
    ledger adds its FLOP model and says how many layers and heads a candidate row has (`n_layers`, `n_heads`)."""
    n_prefix: int
    n_reloc: int
    n_new: int
    active: int = 0
    head_rows_computed: float = 0.0        # over candidate rows, all layers
    token_rows_skipped: float = 0.0

    def head_row_saving(self) -> float:
        units = self.n_reloc * self.n_layers * self.n_heads
        return 0.0 if units == 0 else 1.0 - self.head_rows_computed / units

    def token_row_saving(self) -> float:
        units = self.n_reloc * self.n_layers
        return 0.0 if units == 0 else self.token_rows_skipped / units

    def rows(self) -> dict:
        return {"prefix": self.n_prefix, "relocated": self.n_reloc, "new": self.n_new, "active": self.active}


@dataclass
class Ledger(RowLedger):
    cfg: ModelConfig
    profile: ReuseProfile
    reuse_flops: dict = field(default_factory=lambda: {k: 0.0 for k in OPS})
    ttft_s: dict = field(default_factory=dict)

    @staticmethod
    def start(cfg, profile, n_prefix, n_reloc, n_new) -> "Ledger":
        return Ledger(cfg, profile, n_prefix=n_prefix, n_reloc=n_reloc, n_new=n_new)

    @property
    def n_layers(self) -> int:
        return self.cfg.n_layers

    @property
    def n_heads(self) -> int:
        return self.cfg.n_heads

    # -- accounting hooks called by the consumer ---------------------------------------------------
    def fence_layer(self, layer: int, rows: int, total_rows: int, out_rows: int | None = None) -> None:
        self._layer(layer, rows, total_rows, out_rows)
        self.head_rows_computed += self.n_reloc * self.cfg.n_heads

    def draft_layer(self, layer: int, rows: int, total_rows: int, scored_keys: int) -> None:
        """The question's draft (select="attention", draft.py) through one reusable layer: its `rows` in full, and
        their dense scores over `scored_keys` document rows (computed twice: normalizer, then mass). No candidate
        row is computed, so the head-row and token-row namespaces are unchanged."""
        self._layer(layer, rows, total_rows)
        self.reuse_flops["attention"] += 2 * 2 * rows * self.cfg.n_heads * self.cfg.head_dim * scored_keys

    def _layer(self, layer: int, rows: int, total_rows: int, out_rows: int | None = None) -> None:
        f = layer_flops(self.cfg, layer, rows, start=total_rows - rows, out_rows=out_rows)
        for k in OPS:
            self.reuse_flops[k] += getattr(f, k)

    def set_active(self, n: int) -> None:
        self.active = n

    def latent_rows(self, n: int) -> None:
        self.reuse_flops["projections"] += 2 * n * self.cfg.dim * self.cfg.head_dim

    def reusable_layer(self, layer: int, active_rows: int, restored_rows: int, global_heads: int, pairs: int,
                       indexer_rows: int | None = None) -> None:
        c = self.cfg
        d, H, D, qr, R = c.dim, c.n_heads, c.head_dim, c.q_lora_rank, c.o_lora_rank
        Hg = global_heads
        proj = 2 * active_rows * (d * qr + qr * H * D + H * D * R + c.o_groups * R * d)
        proj += 2 * restored_rows * (d * qr + qr * Hg * D + Hg * D * R + c.o_groups * R * d)
        ratio = c.compress_ratios[layer]
        if ratio:   # the consumer re-pools every relocated and new row's compressor projections
            proj += 2 * 2 * (self.n_reloc + self.n_new) * d * D * (2 if c.layer_kind(layer) == CSA else 1)
        self.reuse_flops["projections"] += proj
        self.reuse_flops["attention"] += 4 * D * pairs
        if c.layer_kind(layer) == CSA:
            rows = active_rows + restored_rows if indexer_rows is None else indexer_rows
            ih, idim = c.index_n_heads, c.index_head_dim
            n_entries = (self.n_prefix + self.n_reloc + self.n_new) // 4
            self.reuse_flops["indexer"] += 2 * rows * (qr * ih * idim + d * ih) + 2 * ih * idim * rows * n_entries / 2
        cand_active = active_rows - self.n_new
        self.head_rows_computed += cand_active * H + (self.n_reloc - cand_active) * Hg
        self.token_rows_skipped += self.n_reloc - cand_active

    def moe_rows(self, rows: int, experts_per_row: float) -> None:
        c = self.cfg
        self.reuse_flops["moe"] += 2 * rows * c.dim * c.n_routed_experts + \
            (experts_per_row + 1) * 3 * 2 * rows * c.dim * c.moe_inter_dim

    # -- the namespaces -----------------------------------------------------------------------------
    def recompute_flops(self) -> dict:
        """The recompute arm: every layer on every row, the last one computing the last row's output only (as
        Transformer.forward does, unless REDKNOT_LAST_LAYER=all)."""
        T = self.n_prefix + self.n_reloc + self.n_new
        out = {k: 0.0 for k in OPS}
        for i in range(self.cfg.n_layers):
            f = layer_flops(self.cfg, i, T, out_rows=prefill_out_rows(self.cfg, i))
            for k in OPS:
                out[k] += getattr(f, k)
        return out

    def flop_saving(self) -> dict:
        ref = self.recompute_flops()
        out = {k: (1 - self.reuse_flops[k] / ref[k]) if ref[k] else 0.0 for k in OPS}
        tot_ref, tot = sum(ref.values()), sum(self.reuse_flops.values())
        out["total"] = 1 - tot / tot_ref
        out["ratio"] = tot_ref / tot if tot else float("inf")
        return out

    def structural_ceiling(self) -> float:
        return self.profile.structural_ceiling(self.cfg)

    def summary(self) -> dict:
        return {
            "rows": self.rows(),
            "head_row_saving": self.head_row_saving(),
            "structural_ceiling": self.structural_ceiling(),
            "token_row_saving": self.token_row_saving(),
            "flop_saving": self.flop_saving(),
            "ttft_s": dict(self.ttft_s),
        }
