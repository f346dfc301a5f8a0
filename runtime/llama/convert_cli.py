"""`redknot models convert-gguf`: convert once, print where the checkpoint is and what it holds."""
from __future__ import annotations

import sys


def run_convert_gguf(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .gguf import ConvertError, convert_gguf

    console = Console()
    try:
        with console.status("converting GGUF (dequantize, un-permute q/k, rebuild tokenizer)"):
            r = convert_gguf(args.gguf, args.out, overwrite=args.force)
    except ConvertError as e:
        print(f"redknot: cannot convert: {e}", file=sys.stderr)
        return 1
    c = r.config
    t = Table(title="converted checkpoint" + (" (cached, not redone)" if r.cached else ""))
    t.add_column("field")
    t.add_column("value")
    for k, v in [("directory", str(r.out)), ("model_type", c.model_type),
                 ("layers / hidden / ffn", f"{c.num_hidden_layers} / {c.hidden_size} / {c.intermediate_size}"),
                 ("heads / kv heads / head_dim", f"{c.num_attention_heads} / {c.num_key_value_heads} / {c.head_dim}"),
                 ("vocab / tied head", f"{c.vocab_size} / {c.tie_word_embeddings}"),
                 ("rope", f"theta={c.rope_theta:g} type={c.rope_type}"),
                 ("source tensor types", ", ".join(f"{k}x{n}" for k, n in sorted(r.quant_types.items()))),
                 ("seconds", f"{r.seconds:.1f}")]:
        t.add_row(k, v)
    console.print(t)
    return 0
