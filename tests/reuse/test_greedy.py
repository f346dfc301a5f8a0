"""The greedy loop every engine and the eval harness share: argmax tokens until the cap or a stop token, which
ends the answer without another step (part of the answer only with keep_stop, as DeepSeek's generate returns it)."""
import torch

from runtime.reuse.greedy import greedy


def one_hot(t: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(t), 10).float()


def test_greedy_stops_and_keeps_the_stop_token_only_when_asked():
    script = [4, 7, 2, 9]                      # the token each step's logits point at
    steps = []

    def step(t):
        steps.append(t)
        return one_hot(script[len(steps)])
    assert greedy(one_hot(script[0]), step, 10, {2}) == [4, 7] and steps == [4, 7]
    steps.clear()
    assert greedy(one_hot(script[0]), step, 10, {2}, keep_stop=True) == [4, 7, 2] and steps == [4, 7]
    steps.clear()
    assert greedy(one_hot(script[0]), step, 2, set()) == [4, 7] and steps == [4, 7]
