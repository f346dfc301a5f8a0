"""RuntimePolicy (runtime/policy.py): the fast path's rules as one frozen value built at the process edge. Its
defaults are the measured-best values, `parse` takes a benchmark's `key=value` items and refuses anything else
before any work, and nothing below the process edge reads the environment except REDKNOT_KERNELS."""
import dataclasses
import re
from pathlib import Path

import pytest

from runtime.policy import DEFAULT_POLICY, RuntimePolicy

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_parse_and_diff():
    p = RuntimePolicy()
    assert p == DEFAULT_POLICY and (p.fused_min_heads, p.key_frame_min_heads, p.moe_grouped_slots) == (16, 16, 1 << 15)
    q = RuntimePolicy.parse(["fused_min_heads=8", " moe_grouped_slots = 0x100 "])
    assert q == p.replace(fused_min_heads=8, moe_grouped_slots=256) and q.diff() == {"fused_min_heads": 8,
                                                                                      "moe_grouped_slots": 256}
    assert RuntimePolicy.parse([]) == p and p.diff() == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.fused_min_heads = 1


@pytest.mark.parametrize("items,match", [(["fused=1"], "must be key=value with key one of"),
                                         (["fused_min_heads"], "must be key=value"),
                                         (["fused_min_heads=many"], "fused_min_heads takes an int"),
                                         (["moe_grouped_slots=-1"], "must be a non-negative int")])
def test_bad_items_are_refused(items, match):
    with pytest.raises(ValueError, match=match):
        RuntimePolicy.parse(items)


def test_set_policy_refuses_what_is_not_a_policy():
    from runtime.model.config import tiny
    from runtime.model.deepseek_v4 import Transformer
    m = Transformer(tiny(n_layers=2, n_hash_layers=1), policy=RuntimePolicy(moe_grouped_slots=7))
    assert m.policy.moe_grouped_slots == 7 and m.layers[0].ffn.policy.moe_grouped_slots == 7
    with pytest.raises(TypeError, match="must be a RuntimePolicy"):
        m.set_policy({"moe_grouped_slots": 1})
    assert m.policy.moe_grouped_slots == 7


def test_no_environment_read_below_the_process_edge():
    """runtime/ reads no environment variable but REDKNOT_KERNELS (the reference-vs-kernels switch) and Triton's
    own TRITON_INTERPRET."""
    allowed = {"runtime/kernels/_triton.py": ("REDKNOT_KERNELS", "TRITON_INTERPRET")}      # the switch lives there
    reads = []
    for f in sorted((ROOT / "runtime").rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"os\.environ|os\.getenv|getenv\(", line) and not line.lstrip().startswith("#"):
                if rel not in allowed or not any(v in line for v in allowed[rel]):
                    reads.append(f"{rel}:{n}: {line.strip()}")
    assert not reads, reads


def test_the_services_build_the_policy_at_their_edge():
    """The builder's and the workers' `policy` setting (REDKNOT_POLICY) is parsed once at start into the policy their
    model runs under; a bad item stops the start with an error that names the setting and the item."""
    import pydantic

    from services.builder.settings import BuilderSettings
    from services.worker.settings import WorkerSettings
    for cls in (BuilderSettings, WorkerSettings):
        assert cls.from_args(None, env={}).runtime_policy() == DEFAULT_POLICY
        s = cls.from_args(None, env={"REDKNOT_POLICY": "fused_min_heads=4, moe_grouped_slots=0"})
        assert s.runtime_policy() == RuntimePolicy(fused_min_heads=4, moe_grouped_slots=0)
        with pytest.raises(pydantic.ValidationError, match=r"policy[\s\S]*'frame=1' must be key=value"):
            cls.from_args(None, env={"REDKNOT_POLICY": "fused_min_heads=4,frame=1"})


def test_prefill_chunk_runs_the_recompute_arm_in_chunks_with_one_forwards_logits_and_cache():
    """`prefill_chunk` bounds a long prompt's activations: the recompute arm (runtime.families.prefill, what the
    worker's recompute, fallbacks and shadows run) extends the cache chunk by chunk, with the logits and the cache of
    one forward (the next step equal too)."""
    from unittest import mock

    import torch

    from runtime.families import prefill
    from tests.tiny import tiny_model
    model = tiny_model()
    tokens = torch.randint(3, model.cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(2))
    whole_cache = model.new_cache()
    whole = model(tokens, whole_cache)
    with model.policy_as(RuntimePolicy(prefill_chunk=16)), mock.patch.object(model, "forward",
                                                                             wraps=model.forward) as fwd:
        cache = model.new_cache()
        got = prefill(model, tokens, cache)
        assert fwd.call_count == 5 and [c.args[0].shape[0] for c in fwd.call_args_list] == [16, 16, 16, 16, 6]
    torch.testing.assert_close(got, whole, atol=1e-5, rtol=1e-5)
    nxt = torch.tensor([int(whole.argmax())])
    torch.testing.assert_close(model(nxt, cache), model(nxt, whole_cache), atol=1e-5, rtol=1e-5)
    assert RuntimePolicy.parse(["prefill_chunk=8192"]).prefill_chunk == 8192
