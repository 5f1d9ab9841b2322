"""A model's tokenizer without transformers or torch: `tokenizers` reads tokenizer.json, jinja2
renders the chat template the way transformers does. The server's main process uses it, so it
never imports torch; a test checks it agrees with transformers token for token."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as Fast

        self._tok = Fast.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special_tokens = {n: _token_text(config.get(n)) for n in SPECIAL_TOKEN_NAMES if config.get(n)}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        self.chat_template = template
        self._compiled = None
        self._max_token_chars: int | None = None
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None

    @property
    def max_token_chars(self) -> int:
        """No token is longer (vocabulary entries are written as bytes or longer: an upper bound on characters)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > 4096:  # encode_batch lets go of the GIL while it works (encode does not)
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = True):
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = self._template().render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       tools=None, documents=None, **self.special_tokens)  # fmt: skip
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self):
        if self._compiled is None:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled = env.from_string(self.chat_template)
        return self._compiled


def _token_text(value) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


def load_tokenizer(model: str | None, convert_here: bool = True) -> Tokenizer | None:
    """The model's tokenizer; tiny-random borrows the default model's when it is installed.
    None when there is none (a folder with weights only: prompts must be token ids)."""
    from minipd.models.files import ModelNotFound, resolve

    folder = resolve(model, convert_here)
    if folder is None:
        try:
            folder = resolve(None, convert_here)
        except ModelNotFound:
            return None
    if not (folder / "tokenizer.json").is_file():
        return None
    return Tokenizer(folder)
