"""Structured outputs: a StructuredOutput turned into a grammar (llguidance), compiled once per engine tokenizer and
spec, and one matcher per request that follows the request's output tokens.

Why llguidance (measured in docs/benchmarks/structured_output.md): it has no dependencies (xgrammar brings
transformers and triton into the engine), it reads tokenizer.json directly, and it rejects the JSON-schema keywords
it cannot enforce (xgrammar compiles `not`, `uniqueItems`, `contains`, `if`/`then` and ignores them), so a schema
we cannot honour is a clear error instead of an output that does not validate.

The matcher's state is a function of the request's output tokens alone: `RequestGrammar.catch_up` compares the
tokens it consumed with the request's and consumes (or rolls back) only the difference. Preemption by recompute
or swap and prefix-cache hits change what is cached, never the tokens, so a resumed request's matcher is already
where it was, and nothing is fed twice.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenfleet.engine.request import StructuredOutput

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

    from tokenfleet.model.tokenizer import Tokenizer

# Between JSON tokens: nothing or one space (`{"a":1}` and `{"a": 1, "b": 2}`). The JSON grammar's default, any
# whitespace, lets a model pad forever (newlines, indents) without ever breaking the grammar, and the tokens it
# spends that way count against max_tokens.
JSON_WHITESPACE = r"(?:\x20)?"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}
_ANY_JSON_OBJECT = '{"type": "object"}'
MAX_ERROR_CHARS = 600  # llguidance's messages can quote the whole grammar
DEFAULT_CACHE_SIZE = 256  # compiled grammars kept per engine (least recently used dropped)


class GrammarError(ValueError):
    """A structured output the grammar engine cannot serve, or a token its matcher refused."""


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."


def _convert(spec: StructuredOutput) -> str:
    """llguidance's grammar for a spec (not checked yet)."""
    from llguidance import LLMatcher, grammar_from

    if spec.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.spec, overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(_ANY_JSON_OBJECT, overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
    if spec.kind == "choice":
        choices = json.loads(spec.spec)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("a choice is a non-empty list of non-empty strings")
        return grammar_from("choice", choices)  # type: ignore[arg-type]
    if spec.kind == "regex":
        return grammar_from("regex", spec.spec)
    return grammar_from("grammar", spec.spec)  # Lark, or GBNF (converted to Lark)


@functools.lru_cache(maxsize=1024)
def grammar_for(spec: StructuredOutput) -> str:
    """The spec's llguidance grammar, checked without a tokenizer: every error in the schema, regex or grammar
    (syntax, unsupported keywords) raises GrammarError here, in whichever process validates the request."""
    from llguidance import LLMatcher

    try:
        grammar = _convert(spec)
    except (ValueError, TypeError) as e:  # bad JSON, a GBNF grammar that does not convert
        raise GrammarError(_short(str(e))) from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(_short(error))
    return grammar


def check_structured_output(spec: StructuredOutput) -> None:
    """Raises GrammarError naming what makes this structured output impossible to serve."""
    grammar_for(spec)


@dataclass
class CompiledGrammar:
    template: LLMatcher  # never advanced: requests get copies
    compile_s: float


class RequestGrammar:
    """One request's matcher. `num_consumed` is how many of its output tokens the matcher has consumed;
    `mask_words` is the length of its token bitmask rows (int32 words)."""

    def __init__(self, matcher: LLMatcher, mask_words: int) -> None:
        self.matcher = matcher
        self.mask_words = mask_words
        self.num_consumed = 0

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: nothing but the end of the output may follow."""
        return self.matcher.is_stopped()

    def accept(self, token_id: int) -> bool:
        """Consumes the request's next output token; True if the grammar is complete with it."""
        if not self.matcher.consume_token(token_id):
            raise GrammarError(f"the structured output refused token {token_id}: {_short(self.matcher.get_error())}")
        self.num_consumed += 1
        return self.matcher.is_stopped()

    def catch_up(self, output_token_ids: Sequence[int]) -> None:
        """Brings the matcher to the end of `output_token_ids` (the request's output so far): consumes what it has
        not seen, or rolls back what the request no longer has (a caller that rewinds a request, as the fleet
        simulator's unpark does)."""
        n = len(output_token_ids)
        if n < self.num_consumed:
            if not self.matcher.rollback(self.num_consumed - n):
                raise GrammarError(f"the structured output could not roll back: {_short(self.matcher.get_error())}")
            self.num_consumed = n
        for token_id in output_token_ids[self.num_consumed :]:
            self.accept(token_id)

    def check_usable(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"the structured output's matcher failed: {_short(self.matcher.get_error())}")


class GrammarCompiler:
    """Compiles structured outputs for one engine's tokenizer, each spec once (LRU cache), and hands every request a
    matcher of its own. Safe from any thread (the replica validates on its event loop while the engine steps)."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size if tokenizer is not None else 0)
        self.eos_token_ids = sorted(t for t in eos_token_ids if 0 <= t < self.vocab_size)
        self.cache_size = cache_size
        self.hits = 0
        self.misses = 0
        self._lltokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def mask_words(self) -> int:
        """int32 words in one row of a token bitmask."""
        return (self.vocab_size + 31) // 32

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return compiled
            self.misses += 1
            compiled = self._compile(spec)
            self._cache[spec] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled

    def matcher(self, spec: StructuredOutput) -> RequestGrammar:
        return RequestGrammar(self.compile(spec).template.deep_copy(), self.mask_words)

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        from llguidance import LLMatcher

        started = time.perf_counter()
        grammar = grammar_for(spec)
        template = LLMatcher(self._tokenizer(), grammar, log_level=0)
        if template.is_error():  # what only the tokenizer can tell, e.g. a special token the vocabulary lacks
            raise GrammarError(_short(template.get_error()))
        if template.is_stopped() or self._allows_only_eos(template):
            raise GrammarError("the structured output allows only an empty output")
        return CompiledGrammar(template, time.perf_counter() - started)

    def _allows_only_eos(self, matcher: LLMatcher) -> bool:
        mask = bytearray(matcher.compute_bitmask())
        for eos in self.eos_token_ids:
            mask[eos // 8] &= ~(1 << (eos % 8)) & 0xFF
        return not any(mask)

    def _tokenizer(self) -> LLTokenizer:
        if self._lltokenizer is None:
            if self.tokenizer is None:
                raise GrammarError("structured outputs need the tokenizer; this engine runs without one")
            from llguidance import LLTokenizer

            backend: Any = copy.copy(self.tokenizer.backend)  # padding or truncation would change every encoding
            backend.no_padding()
            backend.no_truncation()
            self._lltokenizer = LLTokenizer(
                backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        return self._lltokenizer
