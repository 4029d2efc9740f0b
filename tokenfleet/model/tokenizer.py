"""Tokenizer for Hugging Face checkpoint folders, built on the `tokenizers` library alone (no transformers).

Also holds the per-request streaming helpers: `IncrementalDetokenizer` (token ids -> text deltas that never split a
character) and `StopStringMatcher` (stop strings matched across token boundaries, OpenAI semantics).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REPLACEMENT_CHAR = "\ufffd"


@dataclass
class TokenizerFiles:
    """What a checkpoint folder says about its tokenizer, beyond tokenizer.json itself."""

    special_tokens: dict[str, str] = field(default_factory=dict)  # e.g. {"bos_token": "<s>"}
    chat_templates: dict[str, str] = field(default_factory=dict)  # name -> Jinja source; "default" is the main one
    extra_eos_ids: set[int] = field(default_factory=set)  # from config.json / generation_config.json
    config_bos_id: int | None = None
    model_max_length: int | None = None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"could not read {path}: {exc}") from exc


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path} should hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """Special tokens are saved either as plain strings or as AddedToken dicts with a "content" key."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_set(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {item for item in value if isinstance(item, int)}
    return set()


def _parse_chat_templates(value: Any) -> dict[str, str]:
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {item["name"]: item["template"] for item in value if isinstance(item, dict) and "name" in item}
    if isinstance(value, dict):
        return {str(name): template for name, template in value.items() if isinstance(template, str)}
    return {}


def _read_chat_templates(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    # Like transformers, a standalone template file wins over the one embedded in tokenizer_config.json.
    templates = _parse_chat_templates(config.get("chat_template"))
    json_file = folder / "chat_template.json"
    if json_file.is_file():
        templates.update(_parse_chat_templates(_read_optional_json(json_file).get("chat_template")))
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    return templates


def _read_tokenizer_files(folder: Path) -> TokenizerFiles:
    config = _read_optional_json(folder / "tokenizer_config.json")
    legacy_map = _read_optional_json(folder / "special_tokens_map.json")
    model_config = _read_optional_json(folder / "config.json")
    generation = _read_optional_json(folder / "generation_config.json")
    special = {}
    for name in SPECIAL_TOKEN_NAMES:
        content = _token_content(config[name]) if name in config else _token_content(legacy_map.get(name))
        if content is not None:
            special[name] = content
    text_config = model_config.get("text_config") or {}
    extra_eos = set()
    for source in (model_config, text_config, generation):
        extra_eos |= _as_id_set(source.get("eos_token_id"))
    bos = model_config.get("bos_token_id", text_config.get("bos_token_id"))
    max_length = config.get("model_max_length")
    return TokenizerFiles(
        special_tokens=special,
        chat_templates=_read_chat_templates(folder, config),
        extra_eos_ids=extra_eos,
        config_bos_id=bos if isinstance(bos, int) else None,
        model_max_length=max_length if isinstance(max_length, int) and max_length < 10**12 else None,
    )


def _load_backend(folder: Path) -> BackendTokenizer:
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder {folder} does not exist")
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: tokenfleet needs a Hugging Face 'fast' tokenizer file (tokenizer.json) "
            "in the checkpoint folder"
        )
    try:
        return BackendTokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exceptions for any parse error
        raise ValueError(f"could not load {path}: it is not a valid tokenizer.json ({exc})") from exc


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandboxed environment transformers uses, so templates render the same."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson HTML-escapes and ignores these options; templates rely on plain json.dumps output.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """A deep copy in plain containers, so the template cannot reach the caller's objects."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return value


# Names a message's reasoning may come under; templates read the first (and gpt-oss ones read "thinking").
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Like transformers: drop None-valued keys (OpenAI clients send content=None) and alias the reasoning fields."""
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be dicts, got {message!r}")
    plain = {key: value for key, value in _plain(message).items() if value is not None}
    reasoning = next((plain[key] for key in REASONING_FIELDS if key in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


class Tokenizer:
    """Encode/decode and chat templates for one checkpoint; see `from_dir`."""

    def __init__(self, backend: BackendTokenizer, files: TokenizerFiles | None = None) -> None:
        self.backend = backend
        self.files = files or TokenizerFiles()
        self.special_tokens: dict[str, str] = dict(self.files.special_tokens)
        self.chat_templates: dict[str, str] = dict(self.files.chat_templates)
        self.model_max_length = self.files.model_max_length
        self.bos_token_id = self._resolve_bos()
        self.eos_token_ids: set[int] = self._resolve_eos()

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        backend = _load_backend(folder)
        return cls(backend, _read_tokenizer_files(folder))

    # ---- special tokens -------------------------------------------------------------------------------------------

    def _special_id(self, name: str) -> int | None:
        content = self.special_tokens.get(name)
        return None if content is None else self.backend.token_to_id(content)

    def _resolve_bos(self) -> int | None:
        bos = self._special_id("bos_token")
        return bos if bos is not None else self.files.config_bos_id

    def _resolve_eos(self) -> set[int]:
        ids = set(self.files.extra_eos_ids)
        eos = self._special_id("eos_token")
        if eos is not None:
            ids.add(eos)
        return ids

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own EOS (tokenizer_config.json); `eos_token_ids` has every id that ends generation."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> set[int]:
        added = {index for index, token in self.backend.get_added_tokens_decoder().items() if token.special}
        named = {self._special_id(name) for name in self.special_tokens}
        return added | {index for index in named if index is not None}

    # ---- encode / decode ------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, unlike encode, releases the GIL: a long text encoded on a worker thread then leaves the
        # event loop running
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # transformers skips clean_up_tokenization_spaces for BPE models, and it never fits streaming anyway.
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ---- chat templates -------------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    def template_source(self, with_tools: bool = False) -> str | None:
        """The Jinja source a chat without a named template renders with (the "tool_use" one when there are tools,
        where a checkpoint has it); None when it has none."""
        try:
            return self._pick_template(None, [] if with_tools else None)
        except ValueError:
            return None

    def _pick_template(self, name_or_source: str | None, tools: Any) -> str:
        if name_or_source is not None:
            return self.chat_templates.get(name_or_source, name_or_source)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if len(self.chat_templates) == 1:
            return next(iter(self.chat_templates.values()))
        raise ValueError(
            "this checkpoint has no chat template (none in tokenizer_config.json, chat_template.jinja or "
            "chat_template.json); use a plain completion prompt or supply a template"
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """Render `messages` to the prompt string; `extra` variables (e.g. enable_thinking) go to the template.

        `chat_template` may name one of the checkpoint's templates or be Jinja source itself.
        """
        template = compile_chat_template(self._pick_template(chat_template, tools))
        variables = {**self.special_tokens, **_plain(extra)}  # explicit variables win over special tokens
        return template.render(
            messages=[_normalize_message(message) for message in messages],
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **kw: Any) -> list[int]:
        # The template already writes BOS and friends, so the post-processor must not add them again.
        return self.encode(self.apply_chat_template(messages, **kw), add_special_tokens=False)


def _trailing_replacements(text: str) -> int:
    return len(text) - len(text.rstrip(REPLACEMENT_CHAR))


class IncrementalDetokenizer:
    """Turn a stream of generated token ids into text deltas, one request at a time.

    Each step decodes only a small window: a few already-emitted tokens for context plus the pending ones, and emits
    the part of the window's text beyond what was already emitted. The context keeps SentencePiece-style leading
    spaces ("▁world" decodes to "world" on its own), and because the window is short each step is O(1).

    Text is held back while it ends with U+FFFD: the last tokens may hold only part of a multi-byte UTF-8 character.
    The first window starts with the last prompt tokens, as in vLLM/TGI, so a first token such as "▁Paris" keeps its
    space. For byte-level BPE tokenizers the concatenated deltas (plus `flush()`) equal `decode(output_ids)` exactly.
    """

    CONTEXT_TOKENS = 4
    # A valid character spans at most 4 byte tokens; more pending tokens that all end in U+FFFD means the model emits
    # invalid bytes, and holding them back forever would make the window (and each step) grow without bound.
    MAX_PENDING_TOKENS = 16

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.output_ids: list[int] = []
        self._window: list[int] = list(prompt_ids[-self.CONTEXT_TOKENS :]) if self.CONTEXT_TOKENS else []
        self._done = len(self._decode(self._window))  # chars of the window's text already emitted (or prompt)
        self._pending = 0  # window tokens after the last point where the text was complete

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed newly generated ids; return the text they completed (possibly empty)."""
        if not token_ids:
            return ""
        self.output_ids.extend(token_ids)
        self._window.extend(token_ids)
        self._pending += len(token_ids)
        text = self._decode(self._window)
        held = _trailing_replacements(text)
        if held and self._pending > self.MAX_PENDING_TOKENS:
            held = 1  # lossy UTF-8 decoding: only the very last U+FFFD can still turn into a character
        end = len(text) - held
        delta = text[self._done : end] if end > self._done else ""
        self._done = max(self._done, end)
        if not held or self._pending > self.MAX_PENDING_TOKENS:
            self._slide(text, held)
        return delta

    def _slide(self, text: str, held: int) -> None:
        """Everything but `held` trailing characters is emitted: keep only a few tokens of context."""
        self._pending = 0
        if len(self._window) > self.CONTEXT_TOKENS:
            self._window = self._window[-self.CONTEXT_TOKENS :]
            text = self._decode(self._window)
        self._done = len(text) - held

    def flush(self) -> str:
        """The request finished: return any held-back text (an unfinished character becomes U+FFFD, like decode)."""
        text = self._decode(self._window)
        delta = text[self._done :]
        self._slide(text, 0)
        return delta


class StopStringMatcher:
    """Find stop strings in streamed text, even when they span token boundaries (OpenAI semantics).

    Output is truncated just before the first stop string to complete (as if the text arrived one character at a
    time; on a tie the longer one), and the stop string itself is not returned. Any tail of the text that could still
    grow into a stop string is held back until it is known not to; `flush()` releases it when the request ends for
    another reason. Feed token ids with `add` (needs a detokenizer) or text with `feed`.
    """

    def __init__(
        self, stop: Sequence[str] | str | None = None, detokenizer: IncrementalDetokenizer | None = None
    ) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.stop = [s for s in stops if s]
        self.detokenizer = detokenizer
        self.matched: str | None = None
        self._held = ""

    @classmethod
    def for_request(
        cls,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] | str | None = None,
        skip_special_tokens: bool = True,
    ) -> StopStringMatcher:
        return cls(stop, IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens))

    def add(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Feed generated ids; return (new text to send, the stop string if one just matched)."""
        if self.detokenizer is None:
            raise ValueError("StopStringMatcher.add needs a detokenizer; use feed() for text")
        if self.matched is not None:
            return "", None
        return self.feed(self.detokenizer.add(token_ids))

    def feed(self, text: str) -> tuple[str, str | None]:
        """Feed new text; return (text that is safe to send, the stop string if one just matched)."""
        if self.matched is not None or not text:
            return "", None
        buffer = self._held + text
        found = self._find_stop(buffer)
        if found is not None:
            index, self.matched = found
            self._held = ""
            return buffer[:index], self.matched
        keep = self._partial_stop_length(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], None

    def _find_stop(self, buffer: str) -> tuple[int, str] | None:
        """The stop string that a token-by-token reader would see complete first: earliest end, then longest."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self.stop:
            index = buffer.find(stop)
            if index != -1:
                candidate = (index + len(stop), -len(stop), stop)
                best = candidate if best is None or candidate[:2] < best[:2] else best
        return None if best is None else (best[0] + best[1], best[2])

    def _partial_stop_length(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def flush(self) -> str:
        """The request ended without (another) stop match: return everything still held back."""
        if self.matched is not None:
            return ""
        tail = self.detokenizer.flush() if self.detokenizer is not None else ""
        delta, _ = self.feed(tail)
        if self.matched is not None:
            return delta
        delta, self._held = delta + self._held, ""
        return delta
