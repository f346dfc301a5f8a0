"""Arm specs: canonical names, knobs mapped onto the profile (the row-selection rule included), errors named
before any run."""
import pytest

from runtime.eval.arms import Arm, ArmError, arm_list, parse_arm
from runtime.eval.harness import eval_profile


def test_default_arms_keep_the_issue_names():
    assert [a.name for a in arm_list([0.1, 0.2, 0.25], [])] == \
        ["recompute", "prefix-only", "naive", "reuse@10%", "reuse@20%", "reuse@25%"]


def test_names_are_canonical():
    assert parse_arm("reuse@0.25").name == "reuse@25%" == parse_arm("reuse@25%").name
    assert parse_arm("reuse@0.25:ffn=skip:fences=3+3").name == "reuse@25%"        # defaults are not named
    a = parse_arm("reuse@12.5%:lastkv=artifact:ffn=native")
    assert a.name == "reuse@12.5%:ffn=native:lastkv=artifact" and a.budget == 0.125
    assert parse_arm("reuse@0.25:fences=3+3", fences=(2, 2)).name == "reuse@25%:fences=3+3"


def test_knobs_reach_the_profile():
    base = eval_profile((3, 3))
    a = parse_arm("reuse@0.2:fences=4+2:gpg=2:ffn=native:lastkv=artifact:join=8:recent=0:select=deviation:signal=kv")
    p = a.profile(base)
    assert (p.budget, p.first_fences, p.last_fences, p.global_per_group, p.ffn_mode, p.last_fence_kv,
            p.join_rows, p.recent_rows) == (0.2, 4, 2, 2, "native", "artifact", 8, 0)
    assert (p.select, p.signal) == ("deviation", "kv")
    assert Arm("naive").profile(base) == base
    # the eval's default rule is the question's draft attention; the shared controller is a named variant
    assert (parse_arm("reuse@0.25").profile(base).select, parse_arm("reuse@0.25").profile(base).signal) == \
        ("attention", "k")
    assert parse_arm("reuse@0.25:select=mixed").name == "reuse@25%:select=mixed"
    assert parse_arm("reuse@0.25:select=attention").name == "reuse@25%"


@pytest.mark.parametrize("spec, match", [
    ("reuse", "expected one of"), ("reuse@x", "not a number"), ("reuse@0", r"not in \(0, 1\]"),
    ("reuse@0.25:ffn=shared", "not in"), ("reuse@0.25:speed=2", "knob=value"), ("reuse@0.25:ffn", "knob=value"),
    ("reuse@0.25:fences=3", "fences"), ("reuse@0.25:gpg=1:gpg=2", "twice")])
def test_bad_specs_are_named(spec, match):
    with pytest.raises(ArmError, match=match):
        parse_arm(spec)


def test_a_variant_equal_to_a_default_arm_is_refused():
    with pytest.raises(ArmError, match="given twice"):
        arm_list([0.25], ["reuse@0.25:ffn=skip"])
