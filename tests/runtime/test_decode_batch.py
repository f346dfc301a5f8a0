"""One decode step for several requests at once (Transformer.decode): each request's logits and cache equal its own
one-token forwards, whatever the batch holds: requests at different positions (different window fill, compressed
entries and indexer keys, blocks completing on different steps), a batch whose members change between steps, and
one of one. The reference is the model's own one-row forward (float32 on the CPU; the batched products may sum in
another order: ~1e-7 relative measured)."""
import pytest
import torch

from runtime.model.config import tiny_reuse
from runtime.model.deepseek_v4 import Transformer
from tests.tiny import tiny_model

CFG = tiny_reuse()
TOL = 1e-5


def _model(device: str = "cpu") -> Transformer:
    return tiny_model(CFG, seed=11, device=device)


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item() if b.numel() else 0.0


def _state(cache) -> list[torch.Tensor]:
    out = []
    for lc in cache.layers:
        out.append(lc.window_kv)
        for st in (lc.compressor, lc.indexer):
            out += [v for v in vars(st).values() if isinstance(v, torch.Tensor)]
    return out


def _run(m: Transformer, lengths: list[int], steps: int, schedule) -> None:
    """Requests of `lengths` prefilled apart, then `steps` rounds in which the requests schedule(step) names take one
    greedy step together (batched) and, on a second copy, one at a time; logits, tokens and caches compared."""
    dev = m.embed.weight.device
    prompts = [_prompt(n, seed=n).to(dev) for n in lengths]
    batched, alone = [m.new_cache() for _ in lengths], [m.new_cache() for _ in lengths]
    last_b = [m(p, c) for p, c in zip(prompts, batched)]
    last_a = [m(p, c) for p, c in zip(prompts, alone)]
    worst = 0.0
    for step in range(steps):
        ids = schedule(step)
        toks = [int(last_a[i].argmax()) for i in ids]
        assert toks == [int(last_b[i].argmax()) for i in ids]
        out = m.decode(torch.tensor(toks, device=dev), [batched[i] for i in ids])
        assert out.shape == (len(ids), CFG.vocab_size)
        for row, (i, t) in enumerate(zip(ids, toks)):
            last_a[i] = m(torch.tensor([t], device=dev), alone[i])
            last_b[i] = out[row]
            worst = max(worst, _rel(last_b[i].float(), last_a[i].float()))
    assert worst < TOL, worst
    for cb, ca in zip(batched, alone):
        assert cb.pos == ca.pos
        for tb, ta in zip(_state(cb), _state(ca)):
            assert tb.shape == ta.shape and _rel(tb.float(), ta.float()) < TOL


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_batched_step_equals_each_requests_own_step(device):
    # positions 37, 64 and 90 onward (tiny_reuse: window 16, blocks of 4 and 16 rows, top-4 picks): compressor blocks
    # complete on different steps for different requests, and each request's CSA picks are its own
    _run(_model(device), [37, 64, 90], 14, lambda step: [0, 1, 2])


def test_the_batch_may_change_between_steps():
    # request 1 sits out every third step, request 2 joins late: each still continues its own cache exactly
    _run(_model(), [21, 50, 8], 12, lambda step: [i for i in (0, 1, 2) if not (i == 1 and step % 3 == 0)
                                                  and not (i == 2 and step < 4)])


def test_a_batch_of_one_and_bad_input():
    m = _model()
    _run(m, [33], 5, lambda step: [0])
    c = m.new_cache()
    m(_prompt(10, 1), c)
    with pytest.raises(ValueError, match="caches"):
        m.decode(torch.tensor([1, 2]), [c])
    with pytest.raises(ValueError, match="caches"):
        m.decode(torch.tensor([], dtype=torch.long), [])
    assert c.pos == 10                                  # refused: the cache is untouched
    c.layers[0].capture = {}
    with pytest.raises(ValueError, match="captures"):
        m.decode(torch.tensor([1]), [c])
