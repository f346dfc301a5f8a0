"""Tokenizer and chat template of a checkpoint directory, without transformers: tokenizer.json through the
`tokenizers` library, the chat template (chat_template.jinja or tokenizer_config.json) rendered by a
sandboxed Jinja environment configured as transformers configures its own, so both give the same text."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


class TokenizerError(ValueError):
    """A checkpoint directory without a usable tokenizer or chat template; the caller cannot build prompts."""


def _raise(message: str):
    raise TokenizerError(f"chat template: {message}")


@dataclass(frozen=True)
class ChatTokenizer:
    tokenizer: object                        # tokenizers.Tokenizer
    chat_template: str | None
    special: dict[str, str | None]           # bos_token, eos_token, unk_token, pad_token

    @classmethod
    def from_dir(cls, path: str | Path) -> "ChatTokenizer":
        from tokenizers import Tokenizer

        p = Path(path)
        if not (p / "tokenizer.json").is_file():
            raise TokenizerError(f"no tokenizer.json in {p}")
        cfg = json.loads((p / "tokenizer_config.json").read_text()) if (p / "tokenizer_config.json").is_file() else {}
        template = (p / "chat_template.jinja").read_text() if (p / "chat_template.jinja").is_file() \
            else cfg.get("chat_template")
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return cls(Tokenizer.from_file(str(p / "tokenizer.json")), template, special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        return self.tokenizer.token_to_id(text)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ([{role, content}]), as transformers' apply_chat_template renders it."""
        if not self.chat_template:
            raise TokenizerError("this checkpoint has no chat template")
        return _compile(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                   **self.special)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat; the template writes its own special tokens, so none are added."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


def _token_text(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
