"""One question over documents: what every task (loaded or generated) yields and the harness consumes."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class QAExample:
    id: str
    question: str
    answers: tuple[str, ...]                  # every accepted gold answer; metrics take the best match
    paragraphs: tuple[str, ...]               # the documents, in request order
    task: str
    gold: tuple[int, ...] = ()                # indices of paragraphs holding the evidence, when known

    def to_dict(self) -> dict:
        return asdict(self)
