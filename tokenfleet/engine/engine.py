"""Engine.step(): schedule, run the model, sample, and turn new tokens into per-request outputs."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from tokenfleet.engine.config import EngineConfig, SpeculativeConfig
from tokenfleet.engine.kv_blocks import KVBlockManager
from tokenfleet.engine.kv_exchange import KVExchange, kv_layout_of
from tokenfleet.engine.kv_transfer import KVChunk
from tokenfleet.engine.limits import EngineLimits
from tokenfleet.engine.memory import keep_freed_heap
from tokenfleet.engine.outputs import RequestOutput as RequestOutput  # re-exported: they were defined here
from tokenfleet.engine.outputs import RequestTiming
from tokenfleet.engine.outputs import StepStats as StepStats
from tokenfleet.engine.rejection import Proposal, RejectionSampler, Verified
from tokenfleet.engine.request import Request, SamplingParams, TokenLogprob
from tokenfleet.engine.runner import ModelRunner
from tokenfleet.engine.sampler import Sampler
from tokenfleet.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from tokenfleet.engine.speculative import Proposer, Speculator
from tokenfleet.engine.structured import GrammarCompiler
from tokenfleet.model.config import ModelConfig, parse_dtype
from tokenfleet.model.loader import load_model
from tokenfleet.model.tokenizer import StopStringMatcher, Tokenizer

if TYPE_CHECKING:
    import torch

    from tokenfleet.engine.draft import DraftModel
    from tokenfleet.engine.tensor_parallel import TensorParallelGroup

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Tracked:
    req: Request
    detok: StopStringMatcher | None
    text: str = ""


@dataclass
class _Taken:
    """What one step appended to one request, and why it ends, if it does (it is finished after the step's
    accounting)."""

    tracked: _Tracked
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reason: str | None = None
    error: str | None = None


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.resolved_device()
        if self.device.type == "cpu":
            keep_freed_heap()
        dtype = None if config.dtype == "auto" else parse_dtype(config.dtype)
        self.tokenizer = None if config.skip_tokenizer_init else Tokenizer.from_dir(config.model)
        model_config = ModelConfig.from_dir(config.model)
        self.max_model_len = self._max_model_len(config, model_config)
        self.tensor_parallel: TensorParallelGroup | None = None
        self.runner: ModelRunner
        draft = None
        if config.tensor_parallel_size > 1:  # tensor parallel: this process is rank 0 (engine/tensor_parallel.py)
            from tokenfleet.engine.tensor_parallel import TensorParallelGroup

            self.tensor_parallel = TensorParallelGroup(config, model_config, dtype, self.device, self.max_model_len)
            self.model, self.model_config = self.tensor_parallel.model, model_config  # the shard; the whole config
            self.runner = self.tensor_parallel.runner(config, self.device)
        else:
            self.model = load_model(
                config.model, dtype, self.device, max_positions=self.max_model_len, quantization=config.quantization
            )
            self.model_config = self.model.config
            draft = self._draft_model(config.speculative_config, dtype)
            self.runner = ModelRunner(self.model, config, self.device, draft)
        self.blocks = KVBlockManager(
            self.runner.num_blocks,
            config.block_size,
            self.runner.num_host_blocks,
            config.watermark,
            config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.swap_threshold_tokens),
            self.blocks,
        )
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            self.eos_token_ids |= self.tokenizer.eos_token_ids
        self.sampler = Sampler(self.eos_token_ids)
        self.rejection = RejectionSampler(self.sampler)
        self.speculator = self._speculator(config.speculative_config, draft)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.kv_transfer_refusal = self._kv_transfer_refusal(config, draft)
        self.kv_exchange = (
            KVExchange(self.blocks, self.runner, kv_layout_of(config.model, self.runner, config.block_size))
            if self.kv_transfer_refusal is None
            else None
        )
        self.tracked: dict[str, _Tracked] = {}
        self.stats = StepStats()
        self._ids = itertools.count()
        self.limits = EngineLimits(
            self.model_config.vocab_size,
            self.max_model_len,
            config.block_size,
            self.blocks.num_blocks,
            self.blocks.watermark_blocks,
            self.tokenizer is not None,
        )

    def _draft_model(self, config: SpeculativeConfig | None, dtype: torch.dtype | None) -> DraftModel | None:
        if config is None or config.method != "draft_model" or config.model is None:
            return None
        from tokenfleet.engine.draft import DraftModel, check_draft_config

        check_draft_config(ModelConfig.from_dir(config.model), self.model_config, config.model)
        model = load_model(config.model, dtype, self.device, max_positions=self.max_model_len)
        return DraftModel(model, self.config.block_size, self.device)

    def _speculator(self, config: SpeculativeConfig | None, draft: DraftModel | None) -> Speculator | None:
        if config is None:
            return None
        from tokenfleet.engine.draft import DraftProposer
        from tokenfleet.engine.ngram import NgramProposer

        proposer: Proposer
        if draft is not None:
            proposer = DraftProposer(draft, self.sampler)
        else:
            proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        log.info("speculative decoding: %s, k=%d", config.method, config.num_speculative_tokens)
        return Speculator(config, proposer, self.max_model_len)

    def _kv_transfer_refusal(self, config: EngineConfig, draft: DraftModel | None) -> str | None:
        """Why this engine's KV blocks cannot move to or from another replica's (None: they can)."""
        if self.tensor_parallel is not None:
            return "a tensor-parallel engine holds its KV cache split over its ranks"
        if draft is not None:
            return "speculative decoding with a draft model keeps a second KV cache in the same blocks"
        if self.runner.kv_scales is not None:
            return "an FP8 KV cache's scales are calibrated by each replica on its own"
        if not config.enable_prefix_caching:
            return "imported blocks are prefix-cache entries: prefix caching is off"
        return None

    @staticmethod
    def _max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
        window = model_config.max_model_len
        if config.max_model_len is not None and config.max_model_len > window:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context window {window}")
        return config.max_model_len or window

    # --- requests -----------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Validates and queues a request; raises ValueError naming the problem."""
        # a private, re-validated copy: fields changed after construction cannot slip bad values into a batch
        params = SamplingParams() if params is None else dataclasses.replace(params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self._prompt_tokens(prompt)
        self.validate(token_ids, params)
        if params.kv_export and self.kv_exchange is None:
            raise ValueError(f"this engine cannot export KV blocks: {self.kv_transfer_refusal}")
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=self.max_model_len - len(token_ids))
        req = Request(request_id, token_ids, params, priority=priority)
        if params.structured_output is not None:
            req.grammar = self.grammars.matcher(params.structured_output)
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = StopStringMatcher.for_request(self.tokenizer, token_ids, params.stop, params.skip_special_tokens)
        self.tracked[request_id] = _Tracked(req, detok)
        self.scheduler.add(req)
        return req

    def _prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:  # checked before encoding: a BOS token alone does not make a prompt
                raise ValueError("the prompt is empty: it must contain at least one token")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids or enable the tokenizer")
            return self.tokenizer.encode(prompt)
        try:
            return [operator.index(t) for t in prompt]
        except TypeError:
            raise ValueError("a prompt is a string or a list of integer token ids") from None

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError naming what makes this request impossible to serve (safe from any thread)."""
        self.limits.validate(token_ids, params)
        if params.structured_output is not None:  # what only the tokenizer can tell; compiled once, kept for later
            self.grammars.compile(params.structured_output)

    def abort(self, request_id: str) -> bool:
        """Cancels a request in any state; its blocks are freed now. Returns False if it is unknown or done."""
        tracked = self.tracked.pop(request_id, None)
        if tracked is None:
            return False
        self.scheduler.finish(tracked.req, "abort")
        return True

    def exchange_call(self, method: str, args: tuple[Any, ...]) -> int:
        """A KV exchange call from the server's side, run between steps: "cached_prefix" (token ids) or
        "import_chunk" (token ids, KVChunk); see engine/kv_exchange.py."""
        if self.kv_exchange is None:
            raise ValueError(f"this engine cannot take KV blocks from another replica: {self.kv_transfer_refusal}")
        if method == "cached_prefix":
            return self.kv_exchange.cached_prefix(*args)
        if method == "import_chunk":
            return self.kv_exchange.import_chunk(*args)
        raise ValueError(f"unknown KV exchange call {method!r}")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def dead(self) -> str | None:
        """Why this engine can run no more steps (a tensor-parallel rank died), or None while it can."""
        return self.tensor_parallel.lost if self.tensor_parallel is not None else None

    # --- the step -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        stats, started = self.stats, time.perf_counter()
        if self.speculator is not None:
            self.speculator.plan(self.scheduler.running)
        out = self.scheduler.schedule()
        self.runner.keep_cache_ahead_of(self.blocks.num_used_blocks)  # faulted in by a thread once the engine idles
        scheduled = time.perf_counter()
        proposed = scheduled
        try:
            proposals = self.speculator.propose(out) if self.speculator is not None else {}
            proposed = time.perf_counter()
            logits, sampled = self.runner.execute(out)
        except Exception as e:  # a failed forward pass (the target's or the draft's) fails its requests only
            log.exception("model step failed")
            return self._fail_step(out, f"model step failed: {e}")
        executed = time.perf_counter()
        picks = self._sample(logits, sampled, proposals)
        sampled_at = time.perf_counter()
        _share_step_time(out, sampled_at - started)
        # tokens first, then the accounting (it hashes the accepted proposals into the prefix cache), then the
        # requests that ended give their blocks back
        taken = [self._take(chunk, pick) for chunk, pick in zip(sampled, picks)]
        self.scheduler.update(out)
        exports = self._kv_exports(out) if self.kv_exchange is not None else {}
        outputs = [self._output_of(t) for t in taken]
        if exports:
            outputs = self._with_exports(outputs, exports)
        stats.steps += 1
        stats.schedule_s += scheduled - started
        stats.propose_s += proposed - scheduled
        stats.prepare_s += self.runner.last_prepare_s
        stats.forward_s += executed - proposed - self.runner.last_prepare_s
        stats.sample_s += sampled_at - executed
        stats.output_s += time.perf_counter() - sampled_at
        return outputs

    def _kv_exports(self, out: SchedulerOutput) -> dict[str, KVChunk]:
        """The prompt blocks this step computed for requests that export them (before finished ones free theirs)."""
        exchange, exports = self.kv_exchange, {}
        for chunk in out.chunks:
            req = chunk.req
            if req.params.kv_export and exchange is not None and (kv := exchange.export(req)) is not None:
                exports[req.request_id] = kv
        return exports

    def _with_exports(self, outputs: list[RequestOutput], exports: dict[str, KVChunk]) -> list[RequestOutput]:
        """Each export on its request's output; a request that sampled nothing this step (a prefill chunk before
        the last) gets an output with no token to carry it."""
        for output in outputs:
            output.kv_chunk = exports.pop(output.request_id, None)
        for request_id, kv in exports.items():
            tracked = self.tracked.get(request_id)
            if tracked is not None:
                output = self._output(tracked, [], "", [])
                output.kv_chunk = kv
                outputs.append(output)
        return outputs

    def _sample(
        self, logits: torch.Tensor | None, chunks: list[ScheduledChunk], proposals: dict[Request, Proposal]
    ) -> list[Verified | Exception]:
        """Each chunk's new tokens with their logprobs, or the error sampling it raised. Chunks that verify
        proposals own 1 + k rows of logits, the others one. A batch that fails is sampled again chunk by chunk,
        so that only the request whose parameters broke it fails, not its neighbours."""
        if not chunks:
            return []
        if logits is None:  # the runner returns None only for a step with nothing to sample
            raise RuntimeError(f"the model step returned no logits for {len(chunks)} request(s) to sample")
        starts = list(itertools.accumulate((1 + len(c.spec_token_ids) for c in chunks[:-1]), initial=0))
        try:
            return self._sample_batch(logits, chunks, starts, proposals)
        except Exception:
            log.exception("sampling a batch of %d requests failed; sampling them one at a time", len(chunks))
        return [self._sample_alone(logits, chunk, start, proposals) for chunk, start in zip(chunks, starts)]

    def _sample_batch(
        self,
        logits: torch.Tensor,
        chunks: list[ScheduledChunk],
        starts: list[int],
        proposals: dict[Request, Proposal],
    ) -> list[Verified | Exception]:
        plain = [i for i, c in enumerate(chunks) if not c.spec_token_ids]
        verifying = [i for i, c in enumerate(chunks) if c.spec_token_ids]
        picks: dict[int, Verified] = {}
        picks.update(zip(plain, self._sample_plain(logits, [chunks[i] for i in plain], [starts[i] for i in plain])))
        verified = self._verify(logits, [chunks[i] for i in verifying], [starts[i] for i in verifying], proposals)
        picks.update(zip(verifying, verified))
        return [picks[i] for i in range(len(chunks))]

    def _sample_plain(self, logits: torch.Tensor, chunks: list[ScheduledChunk], starts: list[int]) -> list[Verified]:
        if not chunks:
            return []
        rows = logits if len(starts) == logits.shape[0] else logits[starts]
        result = self.sampler(rows, [c.req for c in chunks])
        return [Verified([token], [logprob], 0) for token, logprob in zip(result.token_ids, result.logprobs)]

    def _verify(
        self,
        logits: torch.Tensor,
        chunks: list[ScheduledChunk],
        starts: list[int],
        proposals: dict[Request, Proposal],
    ) -> list[Verified]:
        if not chunks:
            return []
        verified = self.rejection(logits, starts, chunks, [proposals[c.req] for c in chunks])
        if self.speculator is not None:  # else no chunk carries proposals
            for chunk, v in zip(chunks, verified):
                self.speculator.stats.record(len(chunk.spec_token_ids), v.num_accepted)
        return verified

    def _sample_alone(
        self, logits: torch.Tensor, chunk: ScheduledChunk, start: int, proposals: dict[Request, Proposal]
    ) -> Verified | Exception:
        try:
            if chunk.spec_token_ids:
                return self._verify(logits, [chunk], [start], proposals)[0]
            return self._sample_plain(logits, [chunk], [start])[0]
        except Exception as e:
            log.warning("request %s: sampling failed: %r", chunk.req.request_id, e)
            return ValueError(f"sampling failed for this request's parameters: {e}")

    def _fail_step(self, out: SchedulerOutput, message: str) -> list[RequestOutput]:
        return [
            self._fail(tracked, message)
            for chunk in out.chunks
            if (tracked := self.tracked.get(chunk.req.request_id)) is not None
        ]

    def _fail(self, tracked: _Tracked, message: str) -> RequestOutput:
        """Ends the request with finish_reason "error" (its blocks are free now) and says why."""
        req = tracked.req
        self.tracked.pop(req.request_id, None)
        self.scheduler.finish(req, "error")
        req.error = message
        return self._output(tracked, [], "", [])

    def _take(self, chunk: ScheduledChunk, pick: Verified | Exception) -> _Taken:
        """Appends the chunk's new tokens to its request, up to the first that ends it. The request is finished
        later, by _output_of, once the step's accounting is done."""
        req = chunk.req
        tracked = self.tracked[req.request_id]
        if isinstance(pick, Exception):
            chunk.num_rejected = len(chunk.spec_token_ids)
            return _Taken(tracked, error=str(pick))
        chunk.num_rejected = len(chunk.spec_token_ids) - pick.num_accepted
        taken = _Taken(tracked)
        try:
            for token, logprob in zip(pick.token_ids, pick.logprobs):
                self._append(taken, token, logprob)
                if taken.reason is not None:
                    break
        except Exception as e:  # e.g. its stop conditions: this request fails, the rest of the step goes on
            log.exception("request %s: processing its new token failed", req.request_id)
            return _Taken(tracked, error=f"processing the new token failed: {e}")
        return taken

    def _append(self, taken: _Taken, token: int, logprob: TokenLogprob | None) -> None:
        tracked = taken.tracked
        req = tracked.req
        req.append_token(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        reason = self._token_stop(req, token)
        # a structured output ends where its grammar does; its matcher refuses any token it does not allow
        grammar_done = reason != "stop" and req.grammar is not None and req.grammar.accept(token)
        # eos ends the output without text, also the eos a finished grammar accepts under ignore_eos
        adds_text = reason != "stop" and not (grammar_done and token in self.eos_token_ids)
        delta = self._detokenize(tracked, token, adds_text, final=reason is not None or grammar_done)
        if grammar_done:
            reason, req.stop_reason = "stop", None
        if reason != "stop" and tracked.detok is not None and tracked.detok.matched is not None:
            reason, req.stop_reason = "stop", tracked.detok.matched
        taken.token_ids.append(token)
        taken.text += delta
        if logprob is not None:
            taken.logprobs.append(logprob)
        taken.reason = reason

    def _output_of(self, taken: _Taken) -> RequestOutput:
        if taken.error is not None:
            return self._fail(taken.tracked, taken.error)
        req = taken.tracked.req
        if taken.reason is not None:
            self.scheduler.finish(req, taken.reason)
            del self.tracked[req.request_id]
        return self._output(taken.tracked, taken.token_ids, taken.text, taken.logprobs)

    @staticmethod
    def _detokenize(tracked: _Tracked, token: int, adds_text: bool, final: bool) -> str:
        """New text for this token (none for a token that stops the request: eos, a stop token id); the last
        token of a request also flushes what the detokenizer held back."""
        if tracked.detok is None:
            return ""
        delta, _ = tracked.detok.add([token] if adds_text else [])
        if final:
            delta += tracked.detok.flush()
        tracked.text += delta
        return delta

    def _token_stop(self, req: Request, token: int) -> str | None:
        params = req.params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                req.stop_reason = None
                return "stop"
            if token in _not_none(params.stop_token_ids, "stop_token_ids"):
                req.stop_reason = token
                return "stop"
        if req.num_output_tokens >= _not_none(params.max_tokens, "max_tokens") or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, tracked: _Tracked, new_ids: list[int], delta: str, new_lps: list[TokenLogprob]) -> RequestOutput:
        req = tracked.req
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            text=tracked.text,
            new_token_ids=new_ids,
            new_text=delta,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            error=req.error,
            logprobs=req.logprobs,
            new_logprobs=new_lps,
            engine_s=req.engine_s,
            timing=RequestTiming(req.arrival_time, req.scheduled_time, req.num_prefill_chunks)
            if req.num_output_tokens == len(new_ids)
            else None,
        )


def _not_none(value: T | None, name: str) -> T:
    """A SamplingParams field that is never None once the request is added (SamplingParams makes stop_token_ids a
    list, add_request fills in max_tokens): one set to None afterwards fails its request, not the step."""
    if value is None:
        raise TypeError(f"the request's {name} is None")
    return value


def _share_step_time(out: SchedulerOutput, seconds: float) -> None:
    """Splits a step's time over its requests by the tokens each computed in it, so that the requests' engine
    time adds up to the time the engine was busy (what a replica-hour price is divided by)."""
    total = out.num_tokens
    for chunk in out.chunks if total else ():
        chunk.req.engine_s += seconds * chunk.num_tokens / total
