"""The Triton kernels' logic on a machine without a GPU: Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py) runs every kernel on CPU tensors, in float32, inside the 8-layer test model (every layer kind),
against the torch reference path. It checks indexing, masking, the segment walk and the merges on every CI run;
speed, bf16 rounding and compilation are the GPU tests' (test_kernels_gpu.py, test_reuse_gpu.py, on the device).
Skipped where Triton is not installed or a GPU is present (there the compiled kernels are tested instead)."""
import os

import pytest
import torch

import runtime.kernels as K
import runtime.kernels._triton as T
import runtime.reuse.segments as segments_mod
from runtime.model.config import CSA, HCA, WINDOW, tiny_reuse
from runtime.model.deepseek_v4 import Block, hc_mix_weights
from runtime.policy import RuntimePolicy
from runtime.reuse.engine import ReuseEngine
from runtime.reuse.picks import pick_runs, split_picks
from runtime.reuse.producer import produce
from runtime.reuse.profile import ReuseProfile
from tests.tiny import tiny_model

pytestmark = pytest.mark.skipif(not (T.HAVE_TRITON and T.INTERPRET and not torch.cuda.is_available()),
                                reason="needs Triton's interpreter on a machine without a GPU")

CFG = tiny_reuse()
TOL = 1e-5


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def model():
    m = tiny_model(CFG, seed=1)
    return m.eval()


@pytest.fixture(scope="module")
def request_tokens():
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(2, CFG.vocab_size, (n,), generator=g).tolist() for n in (40, 48, 32)]
    return docs, torch.randint(2, CFG.vocab_size, (5,), generator=g).tolist()


@pytest.fixture
def kernels_on(monkeypatch):
    """Route every caller to the Triton kernels on CPU tensors; REDKNOT_KERNELS=0 still selects the reference."""
    calls = {"fused": 0, "sparse": 0}
    on = (lambda t: os.environ.get("REDKNOT_KERNELS", "1") != "0")
    monkeypatch.setattr(K, "enabled", on)
    monkeypatch.setattr(T, "enabled", on)                  # the kernel modules' own read of the switch
    monkeypatch.setattr(segments_mod, "enabled", on)

    def count(key, fn):
        def inner(*a, **kw):
            calls[key] += 1
            return fn(*a, **kw)
        return inner
    monkeypatch.setattr(segments_mod, "multi_segment_attention", count("fused", segments_mod.multi_segment_attention))
    monkeypatch.setattr(segments_mod, "sparse_mqa_parts", count("sparse", segments_mod.sparse_mqa_parts))
    return calls


def fused_launches(monkeypatch) -> list:
    """The names of the fused multi-segment kernels launched from now on, in order (each wrapped in a spy)."""
    import runtime.kernels.multiseg as ms
    launched = []
    for name in ("_multiseg_kernel", "_multiseg_keyframe_kernel", "_multiseg_packed_kernel"):
        kern = getattr(ms, name)
        monkeypatch.setattr(ms, name, type("Spy", (), {"__getitem__": lambda self, grid, k=kern, n=name:
                                                       launched.append(n) or k[grid]})())
    return launched


class DeviceOps:
    """Counts, by name, the torch operations run inside it that would launch work on a GPU (views, reshapes and
    no-op conversions left out): with the Triton launches, what grows with the segments if anything does."""
    FREE = {"view", "_unsafe_view", "slice", "select", "reshape", "as_strided", "expand", "alias", "unsqueeze",
            "squeeze", "t", "transpose", "permute", "detach", "split", "split_with_sizes", "unbind", "lift_fresh",
            "empty", "empty_strided", "empty_like", "new_empty", "_local_scalar_dense", "is_nonzero", "item",
            "sym_size", "sym_stride", "sym_numel", "dim", "size", "stride", "numel", "is_same_size"}

    def __init__(self, skip=lambda: False):
        self.skip = skip                     # while it returns True nothing is counted

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        import collections
        self.counts = collections.Counter()
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                if not outer.skip() and name not in outer.FREE and not (name == "to" and args and out is args[0]):
                    outer.counts[name] += 1
                return out
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self.counts = dict(self.counts)


# each case is minutes under the interpreter, so they are parametrized over three files (here: the first case, which
# runs beside this file's producer, recompute and kernel tests; test_interpret_reuse.py: cases 1-3;
# test_interpret_reuse_key.py: cases 4-6), which `make test` runs on separate processes (--dist loadfile)
# (which calls take the fused kernel, the CSA picks, which fused picks calls take the key frame): "every" / "none"
# set the policy's threshold to 1 / past any head count, "auto" to this model's 8 heads (as 16 is to Flash's 64
# active-row heads and 8 Global heads: the fused kernel for calls of every head, the stacked parts for the Global's)
REUSE_CASES = [("every", "online", "query"), ("every", "artifact", "query"), ("none", "online", "query"),
               ("auto", "artifact", "query"), ("every", "online", "key"), ("every", "artifact", "key"),
               ("none", "artifact", "query")]
NEVER = 1 << 30


def case_policy(fused: str, frame: str) -> RuntimePolicy:
    return RuntimePolicy(fused_min_heads={"every": 1, "none": NEVER, "auto": CFG.n_heads}[fused],
                         key_frame_min_heads=1 if frame == "key" else NEVER,
                         **({"key_frame_min_segments_hca": 0} if fused == "none" else {}))


def reuse_profile(picks: str) -> ReuseProfile:
    return ReuseProfile(first_fences=2, last_fences=2, align=16, budget=0.25, global_picks=picks)


_ARTIFACTS: dict = {}


def reference_artifacts(model, docs, picks: str) -> list:
    """The request's documents produced on the reference path, once per process and `picks` setting: the cases
    compare the consumer's two paths over the same artifacts (the producer through the kernels has its own test,
    test_producer_through_the_kernels_equals_the_reference; under the interpreter it is most of a case's time)."""
    key = (id(model), picks)                            # each module builds its own model (module-scoped fixture)
    if key not in _ARTIFACTS:
        old = os.environ.get("REDKNOT_KERNELS")
        os.environ["REDKNOT_KERNELS"] = "0"
        try:
            _ARTIFACTS[key] = (model, [produce(model, d, reuse_profile(picks)) for d in docs])  # keeps ids unique
        finally:
            if old is None:
                del os.environ["REDKNOT_KERNELS"]
            else:
                os.environ["REDKNOT_KERNELS"] = old
    return _ARTIFACTS[key][1]


@torch.no_grad()
def test_producer_through_the_kernels_equals_the_reference(model, request_tokens, kernels_on, monkeypatch):
    """A document's artifact produced with every kernel on (sparse attention, indexer top-k, mHC, the Local
    contribution's projection) equals the reference path's: every tensor to 1e-5 (float32), the offline picks
    exactly."""
    docs, _ = request_tokens
    prof = reuse_profile("artifact")
    monkeypatch.setenv("REDKNOT_KERNELS", "0")
    want = produce(model, docs[1], prof)
    launches = []
    real = K.sparse_mqa_attention
    monkeypatch.setattr(K, "sparse_mqa_attention", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    monkeypatch.setenv("REDKNOT_KERNELS", "1")
    got = produce(model, docs[1], prof)
    assert launches                                     # the model's attention really went through the kernel
    checked = 0
    for i, (g, w) in enumerate(zip(got.layers, want.layers)):
        for name in ("latent", "entries", "index_keys", "local_p"):
            a, b = getattr(g, name), getattr(w, name)
            assert (a is None) == (b is None), (i, name)
            if a is not None:
                assert a.shape == b.shape and rel_err(a, b) <= TOL, (i, name, rel_err(a, b))
                checked += 1
        for name in ("comp_prev", "index_prev"):
            a, b = getattr(g, name), getattr(w, name)
            assert (a is None) == (b is None), (i, name)
            if a is not None:
                assert max(rel_err(x, y) for x, y in zip(a, b)) <= TOL, (i, name)
        assert (g.picks is None) == (w.picks is None) and (g.picks is None or torch.equal(g.picks, w.picks)), i
    assert checked and any(la.local_p is not None for la in got.layers) and any(la.picks is not None
                                                                                  for la in got.layers)


@torch.no_grad()
@pytest.mark.parametrize("fused,picks,frame", REUSE_CASES[:1])
def test_reuse_prefill_and_decode_through_the_kernels(model, request_tokens, kernels_on, monkeypatch, fused, picks,
                                                      frame):
    errs = reuse_case(model, request_tokens, kernels_on, monkeypatch, fused, picks, frame)
    assert max(errs) <= TOL, errs


def reuse_case(model, request_tokens, kernels_on, monkeypatch, fused, picks, frame) -> list[float]:
    """Reuse prefill at a 25% budget plus 2 greedy decode steps, every kernel on (fences and recompute included),
    through the fused multi-segment kernel, the per-segment kernel + stacked merge, or both (`REUSE_CASES`, the
    model's policy set for the case), equals the reference path on the same rows to 1e-5 (float32). frame "key":
    the fused picks calls through the key-frame kernel, which must have run. The stacked parts' window and causal
    calls (at most 8 heads here) take several query rows per program (`_sparse_mqa_rows_kernel`), which must have
    run (the fence and recompute layers' sparse calls take it in every case)."""
    with model.policy_as(case_policy(fused, frame)):
        return _reuse_case(model, request_tokens, kernels_on, monkeypatch, fused, picks, frame)


def _reuse_case(model, request_tokens, kernels_on, monkeypatch, fused, picks, frame) -> list[float]:
    import runtime.kernels.sparse_attention as sa
    packed = []
    real_rows = sa._sparse_mqa_rows_kernel
    monkeypatch.setattr(sa, "_sparse_mqa_rows_kernel", type("Spy", (), {"__getitem__": lambda self, grid:
                                                                          packed.append(grid) or real_rows[grid]})())
    launched = fused_launches(monkeypatch)
    docs, question = request_tokens
    prof = reuse_profile(picks)
    arts = reference_artifacts(model, docs, picks)
    eng = ReuseEngine(model, prof)
    monkeypatch.setenv("REDKNOT_KERNELS", "0")
    ref = eng.prefill(arts, question)
    want, st = [ref.logits], ref.state
    monkeypatch.setenv("REDKNOT_KERNELS", "1")
    rows = torch.zeros(sum(a.n for a in arts[1:]), dtype=torch.bool)
    rows[ref.active_rows - arts[0].n] = True
    res = eng.prefill(arts, question, active=rows)         # the reference's rows (near-ties may differ)
    got, st2 = [res.logits], res.state
    assert torch.equal(res.active_rows, ref.active_rows)
    for _ in range(2):
        nxt = int(want[-1].argmax())
        monkeypatch.setenv("REDKNOT_KERNELS", "0")
        want.append(eng.decode(st, nxt))
        monkeypatch.setenv("REDKNOT_KERNELS", "1")
        got.append(eng.decode(st2, nxt))
    if fused == "auto":
        assert kernels_on["fused"] > 0 and kernels_on["sparse"] > 0, kernels_on
    else:
        used, unused = ("fused", "sparse") if fused == "every" else ("sparse", "fused")
        assert kernels_on[used] > 0 and kernels_on[unused] == 0, kernels_on
    assert ("_multiseg_keyframe_kernel" in launched) == (frame == "key"), sorted(set(launched))
    assert packed, len(packed)
    return [rel_err(a, b) for a, b in zip(got, want)]      # the prefill's and each decode step's error


@torch.no_grad()
def test_recompute_arm_through_the_kernels(model, kernels_on, monkeypatch):
    """The model alone (sparse attention with pos_shift, indexer top-k, mHC) in chunks then decoding, kernels on,
    equals one reference prefill to 1e-5."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(2, CFG.vocab_size, (80,), generator=g)
    monkeypatch.setenv("REDKNOT_KERNELS", "0")
    ref = model(tokens, all_logits=True)
    monkeypatch.setenv("REDKNOT_KERNELS", "1")
    cache, rows = model.new_cache(), []
    for a in range(0, 70, 37):
        rows.append(model(tokens[a:min(a + 37, 70)], cache, all_logits=True))
    for t in range(70, 73):
        rows.append(model(tokens[t:t + 1], cache, all_logits=True))
    assert rel_err(torch.cat(rows), ref[:73]) <= TOL


@torch.no_grad()
def test_rotary_apply_through_the_rope_kernel(kernels_on, monkeypatch):
    """Rotary.apply's kernel path (the other channels copied, the rope channels by rope_) equals its torch path
    for a [T, D] latent, [T, H, D] heads and strided rows, both directions, and really launches the kernel."""
    import runtime.kernels.rope as R
    from runtime.model.deepseek_v4 import Rotary, yarn_inv_freq
    launched = []
    kern = R._rope_kernel
    monkeypatch.setattr(R, "_rope_kernel", type("Spy", (), {"__getitem__": lambda self, grid:
                                                            launched.append(grid) or kern[grid]})())
    g = torch.Generator().manual_seed(7)
    rot = Rotary(yarn_inv_freq(64, 160000.0, 16.0, 65536, 32.0, 1.0))
    cos, sin = rot.cos_sin(torch.randint(0, 131072, (12,), generator=g))
    big = torch.randn(24, 3, 128, generator=g)
    for x in (big[:12, 0], big[:12], big[::2]):
        for inverse in (False, True):
            monkeypatch.setenv("REDKNOT_KERNELS", "0")
            want = Rotary.apply(x, cos, sin, inverse)
            n = len(launched)
            monkeypatch.setenv("REDKNOT_KERNELS", "1")
            got = Rotary.apply(x, cos, sin, inverse)
            assert len(launched) == n + 1 and got.is_contiguous()
            assert rel_err(got, want) <= 1e-6 and torch.equal(got[..., :-64], x[..., :-64])


def test_mhc_kernels_equal_the_torch_path():
    from runtime.kernels import mhc
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 4, 64, generator=g)
    fn, base = torch.randn(24, 256, generator=g) * 0.05, torch.randn(24, generator=g) * 0.3
    scale, y = torch.tensor([0.8, 1.1, 2.0]), torch.randn(37, 64, generator=g)
    col, pre, post, comb = mhc.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6)
    rpre, rpost, rcomb = hc_mix_weights(x, fn, base, scale, 4, 20, 1e-6, 1e-6)
    assert max(rel_err(pre, rpre), rel_err(post, rpost), rel_err(comb, rcomb)) <= TOL
    assert rel_err(col, (rpre.unsqueeze(-1) * x).sum(1)) <= TOL
    assert rel_err(mhc.hc_post(y, x, post, comb), Block.hc_post(y, x, rpost, rcomb)) <= TOL
    # row maps: y read in another order, the result written into given rows of an existing tensor (others kept)
    perm, rows = torch.randperm(37, generator=g), torch.randperm(50, generator=g)[:37]
    dst = torch.randn(50, 4, 64, generator=g)
    keep = dst.clone()
    got = mhc.hc_post(y, x, post, comb, perm, dst, rows)
    assert got is dst and rel_err(got[rows], Block.hc_post(y[perm], x, rpost, rcomb)) <= TOL
    others = torch.ones(50, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(got[others], keep[others])


@torch.no_grad()
@pytest.mark.parametrize("H,rows_per_program,frame", [(8, None, "query"), (3, None, "query"), (8, 4, "query"),
                                                      (16, None, "query"), (8, 1, "query"), (16, None, "key"),
                                                      (8, 1, "key"), (8, None, "key"), (3, None, "key"), (8, 4, "key"),
                                                      (16, None, "auto"), (8, 1, "auto")])
@pytest.mark.parametrize("kind", ["window", "hca", "csa-own", "csa-union"])
def test_fused_kernel_rows_per_program_equal_the_reference(kind, H, rows_per_program, frame, monkeypatch):
    """runtime/kernels/multiseg.py with few heads runs several query rows per program (their heads fill the MMA
    tile; window and entry tiles shared, each score masked to the rows that see it; picks walked row by row). On
    four segments, query rows with gaps (windows far apart inside one program) and rows crossing the segments'
    joins, it equals the stacked reference path (per-segment torch attention, rotation, merge with the sink) to
    1e-5 in float32. Head counts 8 (2 rows per program; also 4) and 3 (padded to 4 heads, 4 rows); and the one-row
    kernel, which serves calls of 16 heads or more (Flash's 64 active-row heads) and 8 heads with ROWS = 1. (The
    tiny model's 8- and 4-head calls all take the packed kernel under fused_min_heads=1.) frame "key": the one-row
    calls through the key-frame kernel (key_frame=True: each key tile's rope pairs turned by its segment's Delta,
    one loop over the row's keys across segments; with few heads an HCA call holds 64 // heads rows per program
    (8 heads: 8 rows; 3: 16), other calls one row, and a config's ROWS any), "auto" the consumer's default rule
    (the key frame for picks calls of 16 heads or more), which must be the kernel that ran."""
    _fused_equals_reference(kind, H, rows_per_program, frame, [24, 40, 32, 9], [3, 4, 60, 61, 62], (5, 59),
                            monkeypatch)


@torch.no_grad()
@pytest.mark.parametrize("frame", ["key", "query"])
@pytest.mark.parametrize("H", [8, 16])
@pytest.mark.parametrize("kind", ["window", "hca", "csa-own", "csa-union"])
def test_kernels_over_many_short_segments_equal_the_reference(kind, H, frame, monkeypatch):
    """Every fused kernel walks only the segments its rows can reach: the key-frame kernel the segments between
    each key tile's least and greatest key, the query-frame kernels (packed at 8 heads, one row at 16) the
    segments from the one holding its rows' earliest window key to the latest row's, widened to each row's first
    and last segment with picks (causal: from the first). On 14 segments of 1 to 30 rows (key tiles of 16
    spanning up to 6 segments; segments of fewer rows than the compression ratio hold no entry, so their first
    entry id is their successor's; rows whose picks lie in none, or segments before their window) each equals the
    reference, 8 heads (8 rows a program in HCA key-frame calls) and 16."""
    _fused_equals_reference(kind, H, None, frame, [5, 3, 17, 2, 9, 30, 4, 1, 12, 8, 3, 21, 6, 11], [0, 1, 2, 40],
                            (60, 80), monkeypatch)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["window", "hca"])
def test_query_frame_kernels_over_segments_out_of_order_walk_every_segment(kind, monkeypatch):
    """Segments that are not in increasing Delta (or overlap) give no span to narrow the walk to: the query-frame
    kernels then visit every segment, and still equal the reference (8 heads: packed; 16: one row)."""
    for H in (8, 16):
        _fused_equals_reference(kind, H, None, "query", [24, 40, 32, 9], [3, 4, 60, 61, 62], (5, 59), monkeypatch,
                                order=[2, 0, 3, 1])


def _fused_equals_reference(kind, H, rows_per_program, frame, lens, kept, dropped, monkeypatch, order=None):
    """multi_segment_attention over segments of `lens` rows (placed end to end from 0) on a random ~60% of the rows,
    the `kept` rows among them and the `dropped` range not, equals segment_attention's reference path to TOL, and
    the kernel `frame` asks for ran. `order`: the segments handed over in that order (calls without picks)."""
    import types
    from runtime.kernels.multiseg import multi_segment_attention
    launched = fused_launches(monkeypatch)
    from runtime.model.config import CSA, HCA, WINDOW
    from runtime.model.deepseek_v4 import Rotary
    g = torch.Generator().manual_seed(H + len(kind) + len(lens))
    D, W = 64, 8
    ratio = {"window": 0, "hca": 8, "csa-own": 4, "csa-union": 4}[kind]
    deltas = [sum(lens[:j]) for j in range(len(lens))]
    rot = Rotary(1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16)))
    attn = types.SimpleNamespace(kind={"window": WINDOW, "hca": HCA}.get(kind, CSA), ratio=ratio, scale=D ** -0.5,
                                 rotary=rot, indexer=None, cfg=types.SimpleNamespace(window_size=W))
    segs = [segments_mod.SegmentKeys(d, torch.randn(n, D, generator=g),
                                     torch.randn(n // ratio, D, generator=g) if ratio else None)
            for n, d in zip(lens, deltas)]
    if order is not None:
        assert kind in ("window", "hca")
        segs = [segs[j] for j in order]
    keep = torch.rand(sum(lens), generator=g) < 0.6
    keep[kept] = True                  # consecutive rows, and rows far apart in one program
    keep[dropped[0]:dropped[1]] = False
    rows = torch.nonzero(keep).flatten()
    q = torch.randn(rows.numel(), H, D, generator=g)
    sink = torch.randn(H, generator=g)
    mode = {"window": "none", "hca": "causal"}.get(kind, "picks")
    first = [sum(n // 4 for n in lens[:j]) for j in range(len(lens))] if mode == "picks" else None
    picks = bounds = per_seg = None
    if mode == "picks":
        total = sum(n // 4 for n in lens)
        seg_of = torch.searchsorted(torch.tensor(deltas), rows, right=True) - 1
        own_vis = (rows - torch.tensor(deltas)[seg_of] + 1) // 4
        base = torch.tensor(first)[seg_of]
        vis = own_vis if kind == "csa-own" else base + own_vis        # own segment, or every segment up to it
        lo = base if kind == "csa-own" else torch.zeros_like(base)
        ids = lo[:, None] + (torch.rand(rows.numel(), 6, generator=g) * vis[:, None]).long()
        gp = torch.where(torch.rand(ids.shape, generator=g) < 0.2, total, ids)
        picks, bounds = pick_runs(torch.where(vis[:, None] > 0, gp, total), first, total)
        per_seg = split_picks(picks, first, total)
    keyed = frame == "key" or (frame == "auto" and mode == "picks" and H >= RuntimePolicy().key_frame_min_heads)
    out = multi_segment_attention(q, rows, segs, sink, W, mode, ratio or 1, attn.scale, rot.inv_freq, picks, first,
                                  bounds, config=None if rows_per_program is None else {"ROWS": rows_per_program},
                                  key_frame=keyed)
    ref, _ = segments_mod.segment_attention(attn, q, rows, segs, sink, picks=per_seg, qpos_host=rows.numpy())
    assert rel_err(out, ref) <= TOL
    one_row = H >= 16 or rows_per_program == 1
    assert launched == ["_multiseg_keyframe_kernel" if keyed else
                        "_multiseg_packed_kernel" if not one_row else "_multiseg_kernel"]


@torch.no_grad()
@pytest.mark.parametrize("kind", ["window", "hca", "csa-own", "csa-union"])
def test_stacked_parts_in_bounded_launches_equal_the_reference(kind, kernels_on, monkeypatch):
    """segment_attention's stacked path on the kernels (every part's query turned as the kernel loads it, one
    launch per kind of part, one rotation back over every part's served rows, the merge) equals the torch
    reference path (per part: rotation, attention, de-rotation) to 1e-5, over 4 and over 12 segments with rows
    crossing the joins; the Triton launches and the torch operations that would launch on a GPU are the same at
    12 segments as at 4 (own picks go to the picks parts as one tensor of global ids, not split per segment).
    csa-union: picks over every segment (a caller's per segment); each picks part reads only its segment's run of
    the row's sorted ids (`part_runs`), so the picks attended are counted by the kernel's own loop bounds too."""
    import types
    import runtime.kernels.rope as rope_mod
    import runtime.kernels.sparse_attention as sa
    from runtime.model.config import CSA, HCA, WINDOW
    from runtime.model.deepseek_v4 import Rotary
    launched = []
    for mod, name in ((sa, "_sparse_mqa_kernel"), (sa, "_sparse_mqa_rows_kernel"), (rope_mod, "_rope_kernel")):
        kern = getattr(mod, name)
        monkeypatch.setattr(mod, name, type("Spy", (), {"__getitem__": lambda self, grid, k=kern, n=name:
                                                        launched.append(n) or k[grid]})())
    ran_runs, join = [], segments_mod.global_from_split
    monkeypatch.setattr(segments_mod, "part_runs", lambda *a, f=segments_mod.part_runs: ran_runs.append(1) or f(*a))
    g = torch.Generator().manual_seed(5)
    D, W, H = 32, 8, 4
    ratio = {"window": 0, "hca": 8, "csa-own": 4, "csa-union": 4}[kind]
    rot = Rotary(1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8)))
    attn = types.SimpleNamespace(kind={"window": WINDOW, "hca": HCA, "csa-own": CSA, "csa-union": CSA}[kind],
                                 ratio=ratio,
                                 scale=D ** -0.5, rotary=rot, indexer=None, cfg=types.SimpleNamespace(window_size=W))
    counts, stacked = {}, RuntimePolicy(key_frame_min_segments_hca=0)      # HCA too, whatever the default
    for lens in ([24, 40, 32, 9], [24, 16, 40, 8, 32, 24, 16, 40, 8, 32, 24, 9]):
        deltas = [sum(lens[:j]) for j in range(len(lens))]
        segs = [segments_mod.SegmentKeys(d, torch.randn(n, D, generator=g),
                                         torch.randn(n // ratio, D, generator=g) if ratio else None)
                for n, d in zip(lens, deltas)]
        rows = torch.arange(2, sum(lens), 3)
        q = torch.randn(rows.numel(), H, D, generator=g)
        sink = torch.randn(H, generator=g)
        own = per_seg = None
        if kind == "csa-union":       # per segment 3 picks a row among its entries complete before the row, or -1
            per_seg = []
            for d, seg in zip(deltas, segs):
                vis = ((rows - d + 1).clamp(min=0) // 4).clamp(max=seg.entries.shape[0])
                pk = (torch.rand(rows.numel(), 3, generator=g) * vis[:, None]).long()
                per_seg.append(torch.where(vis[:, None] > 0, pk, -1))
        if kind == "csa-own":
            seg_of = torch.searchsorted(torch.tensor(deltas), rows, right=True) - 1
            vis = (rows - torch.tensor(deltas)[seg_of] + 1) // 4
            own = torch.where(vis[:, None] > 0, (torch.rand(rows.numel(), 5, generator=g) * vis[:, None]).long(), -1)
        monkeypatch.setenv("REDKNOT_KERNELS", "0")
        monkeypatch.setattr(segments_mod, "global_from_split", join)
        ref, ref_pairs = segments_mod.segment_attention(attn, q, rows, segs, sink, qpos_host=rows.numpy(),
                                                        own_picks=own, picks=per_seg, policy=stacked)
        assert not launched
        monkeypatch.setenv("REDKNOT_KERNELS", "1")
        if per_seg is not None:       # a caller's lists are joined per segment (its input is per segment): done
            first, total = segments_mod.offsets(segs, "entries")      # here, outside the counted operations
            joined = join(per_seg, first, total, segs)
            monkeypatch.setattr(segments_mod, "global_from_split", lambda *a, j=joined: j)
        before = kernels_on["sparse"]
        with DeviceOps() as ops:
            got, pairs = segments_mod.segment_attention(attn, q, rows, segs, sink, qpos_host=rows.numpy(),
                                                        own_picks=own, picks=per_seg, trig={}, policy=stacked)
        assert kernels_on["sparse"] > before and kernels_on["fused"] == 0    # the stacked path ran, on the kernels
        assert rel_err(got, ref) <= TOL and int(pairs) == int(ref_pairs)
        counts[len(lens)] = (sorted(launched), ops.counts)
        launched.clear()
    assert counts[4] == counts[12] and counts[4][0].count("_rope_kernel") == 1, counts
    assert len(ran_runs) == (2 if kind == "csa-union" else 0)      # the union's parts read their runs, once a call
    assert len(counts[4][0]) <= 3, counts      # window/causal parts, picks parts (csa), the rotation back


def test_hca_calls_over_many_segments_take_the_fused_kernel_whatever_their_heads(kernels_on):
    """RuntimePolicy.key_frame_min_segments_hca: an HCA call of fewer heads than fused_min_heads (Flash's 8 Global
    heads) takes the fused kernel (in the key frame) from that many segments (16 by default: many short documents),
    window and CSA calls from fused_min_segments; a caller's picks always take the stacked parts; 0 leaves HCA calls
    to the other rules."""
    p = RuntimePolicy()
    assert p.key_frame_min_segments_hca == 16 < p.fused_min_segments
    q = torch.zeros(4, 2, 16)
    took = {k: [segments_mod.fused_call(q, None, n, p, k) for n in (15, 16, 47, 48)] for k in (HCA, CSA, WINDOW)}
    assert took == {HCA: [False, True, True, True], CSA: [False, False, False, True],
                    WINDOW: [False, False, False, True]}
    assert not segments_mod.fused_call(q, [None], 48, p, HCA)
    assert [segments_mod.fused_call(q, None, n, p.replace(key_frame_min_segments_hca=0), HCA) for n in (16, 48)] == \
        [False, True]
    assert segments_mod.fused_call(torch.zeros(4, p.fused_min_heads, 16), None, 1, p, CSA)


@torch.no_grad()
def test_hca_calls_over_many_segments_can_take_the_key_frame(kernels_on, monkeypatch):
    """RuntimePolicy.key_frame_min_segments_hca: a fused HCA call over at least that many segments runs in the key
    frame (one loop over the compressed entries across segments, each key tile turned by its segment's Delta) and
    equals the torch reference path; below it (16 by default: many short documents), or unset (0), the query is
    turned per segment."""
    import types
    from runtime.model.deepseek_v4 import Rotary
    launched = fused_launches(monkeypatch)
    g = torch.Generator().manual_seed(11)
    D, W, H, lens = 64, 8, 16, [24, 40, 32, 9]
    deltas = [sum(lens[:j]) for j in range(len(lens))]
    rot = Rotary(1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16)))
    attn = types.SimpleNamespace(kind=HCA, ratio=8, scale=D ** -0.5, rotary=rot, indexer=None,
                                 cfg=types.SimpleNamespace(window_size=W))
    segs = [segments_mod.SegmentKeys(d, torch.randn(n, D, generator=g), torch.randn(n // 8, D, generator=g))
            for n, d in zip(lens, deltas)]
    rows = torch.arange(1, sum(lens), 2)
    q, sink = torch.randn(rows.numel(), H, D, generator=g), torch.randn(H, generator=g)
    monkeypatch.setenv("REDKNOT_KERNELS", "0")
    ref, ref_pairs = segments_mod.segment_attention(attn, q, rows, segs, sink, qpos_host=rows.numpy())
    monkeypatch.setenv("REDKNOT_KERNELS", "1")
    assert RuntimePolicy().key_frame_min_segments_hca == 16
    for least, kernel in ((0, "_multiseg_kernel"), (5, "_multiseg_kernel"), (4, "_multiseg_keyframe_kernel")):
        got, pairs = segments_mod.segment_attention(attn, q, rows, segs, sink, qpos_host=rows.numpy(), trig={},
                                                    policy=RuntimePolicy(key_frame_min_segments_hca=least))
        assert launched == [kernel], (least, launched)
        assert rel_err(got, ref) <= TOL and int(pairs) == int(ref_pairs)
        launched.clear()


def test_table_addresses_keep_the_kernels_alignment_promise():
    """The kernels that read keys at a segment table's addresses are told those are 16-byte aligned
    (tl.multiple_of: without it Triton reads every key tile two bytes at a time; compile_sm90.py checks the PTX's
    16-byte reads). `segment_table` keeps the promise for a view that starts mid-row by pointing at an aligned
    copy of it, and points at an aligned tensor in place (no copy on the served path)."""
    import types
    from runtime.kernels.multiseg import segment_table
    flat = torch.randn(1 + 2 * 24 * 8)
    odd = flat[1:1 + 24 * 8].view(24, 8)                       # 4 bytes past an allocation's start
    even = torch.randn(24, 8)
    assert odd.data_ptr() % 16 and even.data_ptr() % 16 == 0
    segs = [types.SimpleNamespace(delta=0, latent=odd, entries=odd[:6]),
            types.SimpleNamespace(delta=24, latent=even, entries=even[:6])]
    tab, keep = segment_table(segs, "cpu", torch.float32, with_entries=True)
    assert (tab[:, 0] % 16 == 0).all() and (tab[:, 3] % 16 == 0).all()
    def held(addr, want):                                      # a kept tensor at that address holds `want`
        return any(t.data_ptr() == addr and t.shape == want.shape and torch.equal(t, want) for t in keep)
    for j, s in enumerate(segs):
        assert held(int(tab[j, 0]), s.latent) and held(int(tab[j, 3]), s.entries)
    assert int(tab[1, 0]) == even.data_ptr() and int(tab[1, 3]) == even.data_ptr()


@torch.no_grad()
def test_indexer_over_every_segment_in_one_launch_equals_each_segments_frame(model, kernels_on, monkeypatch):
    """The online indexer over relocated segments: the query roped once at t and every segment's keys turned by
    +Delta_j as ONE kernel launch loads them (`indexer_scores_parts`) scores as the model's own indexer does in
    each segment's frame (query roped at t - Delta_j, `Indexer.scores_from`, entries complete before t - Delta_j)
    to 1e-5; the picks equal the reference path's; over 4 and over 12 uneven segments the launches are the same:
    one parts launch, one RoPE (the query), no per-segment scoring."""
    import runtime.kernels.indexer as ix
    import runtime.kernels.rope as rope_mod
    from runtime.reuse.keys import SegmentKeys, offsets
    from runtime.reuse.picks import indexer_global_picks
    launched = []
    for mod, name in ((ix, "_indexer_parts_kernel"), (ix, "_indexer_scores_kernel"), (rope_mod, "_rope_kernel")):
        kern = getattr(mod, name)
        monkeypatch.setattr(mod, name, type("Spy", (), {"__getitem__": lambda self, grid, k=kern, n=name:
                                                        launched.append(n) or k[grid]})())
    attn = next(b.attn for b in model.layers if b.attn.indexer is not None)
    ix_mod, ID = attn.indexer, attn.indexer.head_dim
    g = torch.Generator().manual_seed(11)
    counts = {}
    for lens in ([24, 40, 35, 9], [24, 16, 41, 8, 32, 27, 16, 40, 8, 33, 24, 9]):
        deltas = [sum(lens[:j]) for j in range(len(lens))]
        segs = [SegmentKeys(d, torch.randn(n, CFG.head_dim, generator=g), None,
                            torch.randn(n // 4, ID, generator=g)) for n, d in zip(lens, deltas)]
        rows = torch.arange(1, sum(lens) + 6, 2)
        T = rows.numel()
        h, qr = torch.randn(T, CFG.dim, generator=g), torch.randn(T, CFG.q_lora_rank, generator=g)
        first, total = offsets(segs, "index_keys")
        # the model's own scores, segment by segment in its frame
        q_raw, w_raw = ix_mod.query(h, qr)
        want = torch.cat([ix_mod.scores_from(q_raw, w_raw, rows - s.delta, s.index_keys) for s in segs], dim=1)
        monkeypatch.setenv("REDKNOT_KERNELS", "1")
        q = q_raw.clone()
        K.rope_(q, *attn.rotary.cos_sin(rows))
        launched.clear()
        got = torch.empty(T, total)
        cs = torch.stack(attn.rotary.cos_sin(torch.tensor(deltas)), dim=1)
        K.indexer_scores_parts(q, [s.index_keys for s in segs], deltas, cs,
                               ix_mod.head_weights(q, w_raw), rows, got)
        assert launched == ["_indexer_parts_kernel"]
        assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.isinf(got).any() and (~torch.isinf(got)).any()
        fin = ~torch.isinf(want)
        assert rel_err(got[fin], want[fin]) <= TOL
        launched.clear()
        picks = indexer_global_picks(attn, rows, segs, (h, qr), first, total, trig={})
        counts[len(lens)] = sorted(launched)
        monkeypatch.setenv("REDKNOT_KERNELS", "0")
        ref = indexer_global_picks(attn, rows, segs, (h, qr), first, total)
        assert torch.equal(picks.sort(dim=1).values, ref.sort(dim=1).values)
        assert (picks < total).any()
    assert counts[4] == counts[12] == ["_indexer_parts_kernel", "_rope_kernel"], counts


@torch.no_grad()
@pytest.mark.parametrize("mode", ["none", "causal"])
@pytest.mark.parametrize("H", [1, 3, 8])
def test_sparse_packed_rows_equal_the_reference(mode, H, monkeypatch):
    """`_sparse_mqa_rows_kernel` (several query rows per program for calls of few heads: the reuse consumer's Global
    heads; ROWS x heads = 64 rows of the MMA tile, at most 16 rows) equals the torch reference to 1e-5 in float32,
    and the one-row kernel (config ROWS=1): positions with gaps, unsorted, before 0 and past the keys, a last
    program with rows past T, entries visible from a shifted position. The packed kernel is what ran by default."""
    import runtime.kernels.sparse_attention as sa
    from runtime.kernels.reference import sparse_mqa_reference
    launched = []
    for name in ("_sparse_mqa_kernel", "_sparse_mqa_rows_kernel"):
        kern = getattr(sa, name)
        monkeypatch.setattr(sa, name, type("Spy", (), {"__getitem__": lambda self, grid, k=kern, n=name:
                                                       launched.append(n) or k[grid]})())
    g = torch.Generator().manual_seed(40 + H)
    T, D, W, n, N, ratio = 37, 64, 8, 90, 12, 8
    step = torch.where(torch.rand(T, generator=g) < 0.8, 1, torch.randint(2, 20, (T,), generator=g))
    cpos = torch.cumsum(step, 0) - 6
    cpos[[5, 30]] = cpos[[30, 5]].clone()                       # unsorted
    cpos[-1] = n + 9                                            # past the keys
    q = torch.randn(T, H, D, generator=g)
    keys = torch.randn(n, D, generator=g)
    ent = torch.randn(N, D, generator=g) if mode == "causal" else None
    rows = sa.packed_rows(H, mode)
    assert rows == min(16, 64 // sa.triton.next_power_of_2(H)) and T % rows
    o, lse = sa.sparse_mqa_attention(q, keys, cpos, W, ent, mode, ratio, pos_shift=3)
    assert launched == ["_sparse_mqa_rows_kernel"]
    ro, rl = sparse_mqa_reference(q, keys, cpos, W, ent, mode, ratio, pos_shift=3)
    assert rel_err(o, ro) <= TOL
    assert torch.equal(torch.isinf(lse), torch.isinf(rl)) and torch.isinf(rl).any() and torch.isfinite(rl).any()
    fin = torch.isfinite(rl)
    assert (lse[fin] - rl[fin]).abs().max() <= TOL
    o1, _ = sa.sparse_mqa_attention(q, keys, cpos, W, ent, mode, ratio, pos_shift=3, config={"ROWS": 1})
    assert launched[-1] == "_sparse_mqa_kernel" and rel_err(o1, o) <= TOL
    assert sa.packed_rows(H, "picks") == 1 and sa.packed_rows(16, mode) == 1


def gather_dequant_case(device, dtype, monkeypatch, seed: int = 0):
    """The FP8 restore's gather-dequantize kernel against its torch reference on every e4m3 code but NaN, scales
    at both ends of E8M0's useful range (0 = 2^-127; 246 = 2^119, where 448 x scale is still finite) among
    typical ones, distinct code and scale row ids and a last partial 128-channel block: bit for bit, and the
    kernel really launched."""
    import runtime.kernels.fp8_rows as F
    launched = []
    kern = F._gather_dequant_kernel
    monkeypatch.setattr(F, "_gather_dequant_kernel", type("Spy", (), {"__getitem__": lambda self, grid:
                                                                      launched.append(grid) or kern[grid]})())
    g = torch.Generator().manual_seed(seed)
    R, C = 40, 1100
    codes = torch.randint(0, 256, (R, C), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E                                   # e4m3's NaN codes are never stored
    codes[0, :256] = torch.arange(256, dtype=torch.uint8).masked_fill((torch.arange(256) & 0x7F) == 0x7F, 0)
    scales = torch.randint(110, 140, (R + 3, 9), generator=g, dtype=torch.uint8)
    scales[1, 0], scales[2, 0] = 0, 246
    cid = torch.randint(0, R, (57,), generator=g)
    sid = torch.randint(0, R + 3, (57,), generator=g)
    cid[:3], sid[:3] = 0, torch.tensor([0, 1, 2])
    codes, scales, cid, sid = (t.to(device) for t in (codes, scales, cid, sid))
    fp8 = codes.view(torch.float8_e4m3fn)
    monkeypatch.setenv("REDKNOT_KERNELS", "0")
    want = F.gather_dequant_rows(fp8, scales, cid, sid, torch.empty(57, C, dtype=dtype, device=device))
    assert not launched
    monkeypatch.setenv("REDKNOT_KERNELS", "1")
    got = F.gather_dequant_rows(fp8, scales, cid, sid, torch.full((57, C), float("nan"), dtype=dtype, device=device))
    assert launched
    return got, want


def test_fp8_gather_dequant_kernel_equals_the_reference(kernels_on, monkeypatch):
    got, want = gather_dequant_case("cpu", torch.float32, monkeypatch)
    assert torch.equal(got, want) and torch.isfinite(want).all()
