"""Text in and out of token ids: the model folder's tokenizer (transformers' ``AutoTokenizer``, its chat
template), or bytes for a byte-level model (vocabulary 256, as ``shardkit train`` trains the reference
GPT); and :class:`TextStream`, a request's new tokens turned into text as they come, cut at a stop string.

>>> tok = ByteTokenizer()
>>> tok.encode("hé")
[104, 195, 169]
>>> stream = TextStream(tok.decode, stops=("\\n\\n",))
>>> [stream.push(t) for t in tok.encode("é!\\n\\n")]
[('', False), ('é', False), ('!', False), ('', False), ('', True)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from ..plan import UsageError
from .protocol import RequestError

#: The vocabulary of a byte-level model: token id = byte.
BYTE_VOCAB = 256
#: Tokens a U+FFFD at the end of the text is held back for: a UTF-8 character has at most 4 bytes, so
#: one still there after them is an invalid byte, not an unfinished character.
MAX_HELD = 4
#: Files that mark a folder as holding a transformers tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer(Protocol):
    """What the server needs of a tokenizer."""

    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (a byte-level model); it has no chat template."""

    name = "byte-level (UTF-8 bytes, vocabulary 256)"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        raise RequestError("this model is byte-level and has no chat template; use /v1/completions with a prompt",
                           "messages")


class HFTokenizer:
    """A model folder's tokenizer, read by transformers' ``AutoTokenizer``; chat by its own template."""

    def __init__(self, folder: Path | str):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError, TypeError) as exc:
            raise UsageError(f"--hf {folder}: its tokenizer cannot be read by transformers' AutoTokenizer: "
                             f"{exc}") from None
        self.has_template = bool(getattr(self._tok, "chat_template", None))
        self.name = f"{type(self._tok).__name__} from {folder}" + (", with its chat template" if self.has_template
                                                                   else ", no chat template")

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if not self.has_template:
            raise RequestError("the model folder's tokenizer has no chat template; use /v1/completions", "messages")
        try:
            ids = self._tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # a template's own refusal (e.g. roles out of order) is the request's fault
            raise RequestError(f"the chat template refused these messages: {exc}", "messages") from None
        if hasattr(ids, "keys"):  # transformers 5 answers a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)


def load_tokenizer(folder: Path | str | None, vocab: int | None) -> Tokenizer:
    """The model folder's tokenizer when it has one, else bytes for a byte-level model (vocabulary 256);
    :class:`UsageError` for a model that has neither."""
    if folder is not None and any((Path(folder) / f).is_file() for f in TOKENIZER_FILES):
        return HFTokenizer(folder)
    if vocab == BYTE_VOCAB:
        return ByteTokenizer()
    where = f"--hf {folder} has no tokenizer ({', '.join(TOKENIZER_FILES)})" if folder else "--checkpoint has none"
    raise UsageError(f"the server needs a tokenizer: {where}, and the model's vocabulary is {vocab}, not the "
                     f"{BYTE_VOCAB} bytes of a byte-level model; put the tokenizer's files in the model folder")


class TextStream:
    """A request's tokens as text, piece by piece: ``push`` answers ``(new text, stopped)``.

    Text is held back while it ends in an unfinished UTF-8 character (at most :data:`MAX_HELD` tokens) or
    could be the start of a stop string; at a stop string the text ends before it (as OpenAI's ``stop``)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()):
        self._decode, self._stops = decode, tuple(stops)
        self._ids: list[int] = []
        self._sent = 0  # characters of the text given out
        self._held = 0  # tokens in a row whose text ended in U+FFFD
        self.text = ""

    def push(self, token: int) -> tuple[str, bool]:
        self._ids.append(token)
        self.text = self._decode(self._ids)
        found = [i for i in (self.text.find(s) for s in self._stops) if i >= 0]
        if found:
            return self._give(min(found)), True
        end = len(self.text)
        if self._held < MAX_HELD:  # an unfinished character decodes as U+FFFD until its last byte comes
            end = len(self.text.rstrip("\ufffd"))
            self._held = self._held + 1 if end < len(self.text) else 0
        for k in range(min(end, max((len(s) for s in self._stops), default=1) - 1), 0, -1):
            if any(s.startswith(self.text[end - k:end]) for s in self._stops):
                end -= k
                break
        return self._give(end), False

    def finish(self) -> str:
        """What is left once the request ended without a stop string."""
        return self._give(len(self.text))

    def _give(self, end: int) -> str:
        if end == len(self.text):
            self._held = 0
        out = self.text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out
