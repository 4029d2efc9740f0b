"""Speculative decoding (n-gram and draft model): greedy output is the output without it, whatever the scheduling
(alone, a busy batch with chunked prefill and prefix hits, preemption by recompute and swap, cancellation); stops cut
an accepted run where decoding without it would have stopped; sampling keeps the target's distribution; no KV block
leaks; the acceptance counters add up.

The checkpoints are made with small weights (REPETITIVE): their greedy outputs fall into loops after a while, so
n-gram proposals are accepted often and rejected often, and both paths run. A draft model that is the target
itself proposes exactly the target's argmax: every greedy proposal is accepted.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from tests.checkpoints import ARCHITECTURES, SMALL_KV, make_checkpoint
from tests.engine.test_block_accounting import check_invariants, operations
from tokenfleet import LLM, SamplingParams
from tokenfleet.engine.engine import Engine
from tokenfleet.engine.kv_blocks import KVBlockManager
from tokenfleet.engine.ngram import ngram_lookup
from tokenfleet.engine.rejection import Proposal, RejectionSampler
from tokenfleet.engine.request import Request, RequestStatus, StructuredOutput
from tokenfleet.engine.sampler import Sampler
from tokenfleet.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from tokenfleet.engine.state import EngineState

REPETITIVE = dict(initializer_range=0.05)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def self_draft(path) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama-rep"), "llama", **REPETITIVE)


@pytest.fixture(scope="module")
def other_draft_dir(llama_dir, tmp_path_factory):
    """The target's first layer alone (its embeddings and head too): a smaller model that agrees with it now and
    then, as a real draft does."""
    return truncated(llama_dir, tmp_path_factory.mktemp("llama-draft"), num_layers=1)


def truncated(source: Path, dest: Path, num_layers: int) -> Path:
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (dest / "config.json").write_text(json.dumps(config))
    kept = {
        name: tensor
        for name, tensor in load_file(source / "model.safetensors").items()
        if ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < num_layers
    }
    save_file(kept, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def prompts(count: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    """Prompts that repeat a random pattern (so lookup finds n-grams from the start), some after a shared prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 384) for _ in range(shared)]
    out = []
    for _ in range(count):
        pattern = [rng.randrange(3, 384) for _ in range(rng.randint(3, 9))]
        out.append(prefix + pattern * rng.randint(1, 4) + [rng.randrange(3, 384) for _ in range(rng.randint(0, 20))])
    return out


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


def generate(llm: LLM, token_prompts: list[list[int]], params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in token_prompts], params)


def assert_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, "a KV block leaked"
    assert len(engine.blocks.free_host) == engine.runner.num_host_blocks, "a swap block leaked"


def spec_stats(llm: LLM):
    assert llm.engine.speculator is not None
    return llm.engine.speculator.stats


def same_outputs(expected: list, got: list) -> None:
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert b.token_ids == a.token_ids, f"request {i} diverged"
        assert (b.finish_reason, b.stop_reason, b.text) == (a.finish_reason, a.stop_reason, a.text), f"request {i}"


# --- greedy output: identical ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_identical_alone_on_every_architecture(arch, tmp_path):
    path = make_checkpoint(tmp_path / arch, arch, **REPETITIVE)
    batch = prompts(3, seed=1)
    base = [generate(LLM(str(path), skip_tokenizer_init=True, **SMALL_KV), [p], greedy(40))[0] for p in batch]
    for config in (NGRAM, self_draft(path)):
        llm = LLM(str(path), skip_tokenizer_init=True, speculative_config=config, **SMALL_KV)
        same_outputs(base, [generate(llm, [p], greedy(40))[0] for p in batch])
        stats = spec_stats(llm)
        assert stats.num_accepted_tokens > 0, f"{config['method']}: no proposal was ever accepted"
        if config["method"] == "draft_model":  # the target as its own draft: every proposal is its argmax
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert_clean(llm)


@pytest.mark.parametrize("method", ["ngram", "self_draft", "other_draft"])
def test_greedy_identical_in_a_busy_batch_with_chunked_prefill_and_prefix_hits(llama_dir, other_draft_dir, method):
    config = {"ngram": NGRAM, "self_draft": self_draft(llama_dir), "other_draft": self_draft(other_draft_dir)}[method]
    options = dict(skip_tokenizer_init=True, max_num_batched_tokens=48, max_num_seqs=6, **SMALL_KV)
    batch = prompts(10, seed=2, shared=40) + prompts(4, seed=3)
    lengths = [random.Random(i).randint(4, 30) for i in range(len(batch))]
    expected = generate(LLM(str(llama_dir), **options), batch, [greedy(n) for n in lengths])
    llm = LLM(str(llama_dir), speculative_config=config, **options)
    same_outputs(expected, generate(llm, batch, [greedy(n) for n in lengths]))
    again = generate(llm, batch[:3], [greedy(n) for n in lengths[:3]])  # every block of these is cached now
    same_outputs(expected[:3], again)
    assert all(out.num_cached_tokens > 0 for out in again)
    assert llm.engine.scheduler.prefix_cache_hits > 0
    stats = spec_stats(llm)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert_clean(llm)


@pytest.mark.parametrize("swap_threshold", [10_000, 16], ids=["recompute", "swap"])
@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_greedy_identical_under_preemption(llama_dir, method, swap_threshold):
    config = NGRAM if method == "ngram" else self_draft(llama_dir)
    kv_block_bytes = 2 * 2 * 2 * 16 * 4 * 16  # layers x K,V x KV heads x head dim x fp32 x block
    if method == "self_draft":
        kv_block_bytes *= 2  # the draft's cache takes its share of the same budget
    options = dict(
        skip_tokenizer_init=True,
        kv_cache_gib=14 * kv_block_bytes / (1 << 30),
        watermark=0.0,
        swap_threshold_tokens=swap_threshold,
        swap_space_gib=SMALL_KV["swap_space_gib"],
    )
    batch = prompts(8, seed=4)
    expected = generate(LLM(str(llama_dir), **options), batch, greedy(30))
    llm = LLM(str(llama_dir), speculative_config=config, **options)
    assert llm.engine.blocks.num_blocks == 14
    seen = []
    original = llm.engine.scheduler._preempt

    def spy(req, out):
        refund = original(req, out)
        seen.append(req.status)
        return refund

    llm.engine.scheduler._preempt = spy
    same_outputs(expected, generate(llm, batch, greedy(30)))
    assert (RequestStatus.SWAPPED if swap_threshold == 16 else RequestStatus.WAITING) in seen, "no preemption"
    assert spec_stats(llm).num_accepted_tokens > 0
    assert_clean(llm)


@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_cancel_between_verifications(llama_dir, method):
    config = NGRAM if method == "ngram" else self_draft(llama_dir)
    batch = prompts(4, seed=5)
    expected = generate(LLM(str(llama_dir), skip_tokenizer_init=True, **SMALL_KV), batch, greedy(40))
    llm = LLM(str(llama_dir), skip_tokenizer_init=True, speculative_config=config, **SMALL_KV)
    engine: Engine = llm.engine
    reqs = [engine.add_request(p, greedy(40), request_id=f"r{i}") for i, p in enumerate(batch)]
    stats = spec_stats(llm)
    for _ in range(30):  # well into speculation, with proposals in flight
        engine.step()
        if stats.num_accepted_tokens >= 6:
            break
    victims = [r for r in reqs if not r.is_finished and r.num_lookahead_tokens][:2]
    assert victims, "no running request had proposals planned"
    for req in victims:
        assert engine.abort(req.request_id)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    for i, req in enumerate(reqs):
        if req in victims:
            assert req.finish_reason == "abort"
        else:
            assert req.output_token_ids == expected[i].token_ids
    assert_clean(llm)


# --- stops, limits and logprobs cut the accepted run ------------------------------------------------------------


def test_stop_token_ids_max_and_min_tokens_and_eos(llama_dir, tmp_path):
    batch = prompts(4, seed=6)
    reference = generate(LLM(str(llama_dir), skip_tokenizer_init=True, **SMALL_KV), batch, greedy(40))
    base = LLM(str(llama_dir), skip_tokenizer_init=True, **SMALL_KV)
    spec = LLM(str(llama_dir), skip_tokenizer_init=True, speculative_config=NGRAM, **SMALL_KV)
    cases = []
    for out in reference:
        later = out.token_ids[10:]
        cases.append(greedy(40, stop_token_ids=[later[len(later) // 2]]))
        cases.append(SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[later[0]], min_tokens=25))
    cases += [greedy(n) for n in range(1, 13)]
    cases += [greedy(40, frequency_penalty=0.5), greedy(40, repetition_penalty=1.3), greedy(40, presence_penalty=-1)]
    token_prompts = [batch[i % len(batch)] for i in range(len(cases))]
    same_outputs(generate(base, token_prompts, cases), generate(spec, token_prompts, cases))
    assert spec_stats(spec).num_accepted_tokens > 0
    assert_clean(spec)

    # eos, ignore_eos and min_tokens: the same weights with a token of the loops as their eos
    eos = reference[0].token_ids[20]
    eos_dir = make_checkpoint(tmp_path / "eos", "llama", eos_token_id=eos, **REPETITIVE)
    base = LLM(str(eos_dir), skip_tokenizer_init=True, **SMALL_KV)
    spec = LLM(str(eos_dir), skip_tokenizer_init=True, speculative_config=NGRAM, **SMALL_KV)
    cases = [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, min_tokens=30),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    ]
    expected = generate(base, [batch[0]] * 3, cases)
    assert expected[0].finish_reason == "stop" and expected[0].token_ids[-1] == eos
    assert len(expected[1].token_ids) > len(expected[0].token_ids), "min_tokens did not hold eos back"
    same_outputs(expected, generate(spec, [batch[0]] * 3, cases))
    assert_clean(spec)


def test_stop_strings_and_text(demo_model_dir):
    """Stop strings need text: the demo checkpoint (a trained tokenizer) loops too on a repetitive prompt."""
    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n" * 3
    base = LLM(str(demo_model_dir), **SMALL_KV)
    spec = LLM(str(demo_model_dir), speculative_config=NGRAM, **SMALL_KV)
    full = base.generate(text, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[0]
    tail = full.text[len(full.text) // 2 :]
    stops = [tail[3:6], tail[10:12], full.text[-4:]]
    cases = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stop=[s]) for s in stops if s.strip()]
    cases.append(SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stop=stops))
    expected = base.generate([text] * len(cases), cases)
    assert any(out.finish_reason == "stop" for out in expected)
    same_outputs(expected, spec.generate([text] * len(cases), cases))
    assert spec_stats(spec).num_accepted_tokens > 0
    assert_clean(spec)


def test_logprobs_of_accepted_tokens(llama_dir):
    batch = prompts(3, seed=7)
    params = greedy(30, logprobs=3)
    expected = generate(LLM(str(llama_dir), skip_tokenizer_init=True, **SMALL_KV), batch, params)
    spec = LLM(str(llama_dir), skip_tokenizer_init=True, speculative_config=NGRAM, **SMALL_KV)
    got = generate(spec, batch, params)
    assert spec_stats(spec).num_accepted_tokens > 0
    for a, b in zip(expected, got):
        assert b.token_ids == a.token_ids and len(b.logprobs) == len(a.logprobs) == 30
        for x, y in zip(a.logprobs, b.logprobs):
            assert y.token_id == x.token_id
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
            assert [t for t, _ in y.top] == [t for t, _ in x.top]
            assert [v for _, v in y.top] == pytest.approx([v for _, v in x.top], abs=1e-4)


# --- sampling keeps the target's distribution -------------------------------------------------------------------

# chi-square critical values at p = 0.001 by degrees of freedom (a seeded test: fails only on a real difference)
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def chi_square(observed: Counter, probs: list[float], n: int) -> tuple[float, int]:
    """Pearson's statistic against expected counts n * p (cells under 5 expected pooled), and its df."""
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for token, p in enumerate(probs):
        if n * p >= 5:
            cells.append((observed[token], n * p))
        else:
            pooled_obs, pooled_exp = pooled_obs + observed[token], pooled_exp + n * p
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


@pytest.mark.parametrize("proposer", ["point_mass", "draft_distribution"])
def test_rejection_sampler_keeps_the_target_distribution(proposer):
    """Many seeded verifications on a 6-token vocabulary: the first emitted token follows the target's p0, and the
    second, when the first proposal was kept, follows p1 (chi-square, p = 0.001)."""
    torch.manual_seed(0)
    vocab, k, n = 6, 2, 6000
    target_logits = torch.randn(k + 1, vocab) * 1.5
    draft_probs = torch.softmax(torch.randn(k, vocab), dim=-1)
    p = torch.softmax(target_logits, dim=-1)
    chunks, proposals = [], []
    for i in range(n):
        req = Request(f"r{i}", [1], SamplingParams(temperature=1.0, max_tokens=8))
        req.append_token(0)
        if proposer == "point_mass":  # n-gram: always the same, one likely and one unlikely proposal
            tokens, q = [int(p[0].argmax()), int(p[1].argmin())], None
        else:
            tokens = [int(torch.multinomial(draft_probs[j], 1)) for j in range(k)]
            q = draft_probs
        chunks.append(ScheduledChunk(req, 1 + k, k, tokens))
        proposals.append(Proposal(tokens, q))
    logits = target_logits.repeat(n, 1)
    verified = RejectionSampler(Sampler({2}))(logits, [i * (k + 1) for i in range(n)], chunks, proposals)
    first = Counter(v.token_ids[0] for v in verified)
    stat, df = chi_square(first, p[0].tolist(), n)
    assert stat < CHI2_999[df], f"first token: chi2 {stat:.1f} with {df} df"
    kept = [v for v, c in zip(verified, chunks) if v.num_accepted >= 1]
    second = Counter(v.token_ids[1] for v in kept)
    stat, df = chi_square(second, p[1].tolist(), len(kept))
    assert stat < CHI2_999[df], f"second token: chi2 {stat:.1f} with {df} df over {len(kept)} draws"
    assert 0 < len(kept) < n and any(v.num_accepted == 0 for v in verified)


@pytest.mark.parametrize("method", ["ngram", "other_draft"])
def test_sampled_output_matches_sampling_without_speculation(llama_dir, other_draft_dir, method):
    """End to end, seeded, loose: the tokens at each of the first outputs are distributed alike with and without
    speculation (two-sample chi-square over the tokens seen, p = 0.001)."""
    config = NGRAM if method == "ngram" else self_draft(other_draft_dir)
    prompt = prompts(1, seed=8)[0][:6] * 4
    n, length = 400, 6
    params = [SamplingParams(max_tokens=length, temperature=0.8, top_k=4, seed=s, ignore_eos=True) for s in range(n)]
    options = dict(skip_tokenizer_init=True, max_num_seqs=n, max_num_batched_tokens=8192, **SMALL_KV)
    base = generate(LLM(str(llama_dir), **options), [prompt] * n, params)
    spec = LLM(str(llama_dir), speculative_config=config, **options)
    got = generate(spec, [prompt] * n, [dataclasses.replace(p, seed=p.seed + 10_000) for p in params])
    stats = spec_stats(spec)
    assert stats.num_accepted_tokens > 30 and stats.num_draft_tokens > stats.num_accepted_tokens
    for position in range(length):
        a = Counter(o.token_ids[position] for o in base)
        b = Counter(o.token_ids[position] for o in got)
        tokens = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
        rest = (n - sum(a[t] for t in tokens), n - sum(b[t] for t in tokens))
        cells = [(a[t], b[t]) for t in tokens] + ([rest] if sum(rest) else [])
        stat = sum((x - y) ** 2 / (x + y) for x, y in cells)  # equal sample sizes
        df = len(cells) - 1
        assert df == 0 or stat < CHI2_999.get(df, 24.32 + 2 * (df - 7)), f"position {position}: chi2 {stat:.1f}"


# --- what speculates, what does not, and what it reports --------------------------------------------------------


def test_opt_out_and_structured_outputs_do_not_speculate(demo_model_dir):
    spec = LLM(str(demo_model_dir), speculative_config=NGRAM, **SMALL_KV)
    text = "one two three one two three one two three"
    out = spec.generate(text, SamplingParams(max_tokens=30, temperature=0.0, speculative_decoding=False))[0]
    assert len(out.token_ids) == 30 and spec_stats(spec).num_drafts == 0
    choice = SamplingParams(max_tokens=30, temperature=0.0, structured_output=StructuredOutput.choice(["yes", "no"]))
    out = spec.generate(text, choice)[0]
    assert out.text in ("yes", "no") and spec_stats(spec).num_drafts == 0
    spec.generate(text, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert spec_stats(spec).num_drafts > 0
    assert_clean(spec)


def test_acceptance_counters(llama_dir):
    llm = LLM(str(llama_dir), skip_tokenizer_init=True, speculative_config=NGRAM, **SMALL_KV)
    outputs = generate(llm, prompts(4, seed=9), greedy(40))
    state = EngineState.of(llm.engine)
    spec = state.spec_decode
    assert spec is not None and spec.num_drafts > 0
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens <= 4 * spec.num_drafts
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens
    assert spec.accepted_per_position == sorted(spec.accepted_per_position, reverse=True)
    assert spec.acceptance_rate == pytest.approx(spec.num_accepted_tokens / spec.num_draft_tokens)
    assert spec.mean_accepted_length == pytest.approx(1 + spec.num_accepted_tokens / spec.num_drafts)
    # every step yields one token per sampled request, plus what verification accepted
    generated = sum(len(o.token_ids) for o in outputs)
    assert llm.engine.stats.steps < generated
    assert EngineState.of(LLM(str(llama_dir), skip_tokenizer_init=True, **SMALL_KV).engine).spec_decode is None


def test_ngram_lookup():
    import numpy as np

    seq = np.array([5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7])
    assert ngram_lookup(seq, 1, 3, 2) == [9, 2]  # the latest occurrence of (5, 6, 7) followed by two tokens
    assert ngram_lookup(seq, 1, 3, 6) == [8, 1, 5, 6, 7, 9]  # only the first is followed by six
    assert ngram_lookup(np.array([1, 2, 3, 4]), 1, 3, 3) == []
    assert ngram_lookup(np.array([1, 2, 9, 3, 2]), 2, 3, 3) == []  # only a 1-gram matches
    assert ngram_lookup(np.array([4, 4, 4, 4]), 1, 4, 3) == [4]  # never past the sequence's end


# --- bad configurations: clear errors, naming the setting --------------------------------------------------------


def test_bad_configurations(llama_dir, tmp_path):
    bad = [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "eagle"}, "method"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "draft_model"}, "model"),
        ({"k": 3}, "unknown speculative_config key"),
    ]
    for config, named in bad:
        with pytest.raises(ValueError, match=named):
            LLM(str(llama_dir), skip_tokenizer_init=True, speculative_config=config, **SMALL_KV)
    other_vocab = make_checkpoint(tmp_path / "vocab", "llama", vocab_size=500)
    with pytest.raises(ValueError, match="speculative_config.model .* vocabulary of 500 tokens"):
        LLM(str(llama_dir), skip_tokenizer_init=True, speculative_config=self_draft(other_vocab), **SMALL_KV)
    done = subprocess.run(
        [sys.executable, "-m", "tokenfleet", "replica", "--model", str(llama_dir), "--speculative-config", "{k: 3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--speculative-config" in done.stderr and "not valid JSON" in done.stderr


# --- block accounting under random speculation ------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=operations,
    num_blocks=st.integers(12, 40),
    threshold=st.sampled_from([4, 1000]),
    budget=st.sampled_from([8, 32, 256]),
    prefix_caching=st.booleans(),
)
def test_no_block_leaks_with_random_lookahead_and_acceptance(ops, num_blocks, threshold, budget, prefix_caching):
    """The engine's order on scheduler records: proposals planned, lookahead slots allocated, a random number of
    them accepted, tokens appended, accounting (rejected tail trimmed), then the finished ones freed."""
    host_blocks = 16
    blocks = KVBlockManager(num_blocks, 4, host_blocks, watermark=0.05, enable_prefix_caching=prefix_caching)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, swap_threshold_tokens=threshold), blocks
    )
    live: list[Request] = []
    for i, op in enumerate(ops):
        if op[0] == "submit":
            _, prompt_len, max_tokens, priority, prefix = op
            if blocks.blocks_for(prompt_len + max_tokens) > num_blocks - blocks.watermark_blocks:
                continue
            prompt = [prefix] * min(prompt_len, 8) + list(range(100, 100 + max(0, prompt_len - 8)))
            req = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), priority=priority)
            sched.add(req)
            live.append(req)
        elif op[0] == "step":
            speculative_step(sched, random.Random(op[1]))
        elif live:
            sched.finish(live[op[1] % len(live)], "abort")
        live = [r for r in live if not r.is_finished]
        check_invariants(blocks, sched, host_blocks)
        for req in sched.running:
            assert len(req.block_table) == blocks.blocks_for(req.num_computed_tokens), "rejected slots kept"
    for req in live:
        sched.finish(req, "abort")
    check_invariants(blocks, sched, host_blocks)
    assert blocks.num_free_blocks == num_blocks
    assert not sched.has_work()


def speculative_step(sched: Scheduler, rng: random.Random) -> None:
    for req in sched.running:
        room = req.params.max_tokens - req.num_output_tokens - 1
        req.num_lookahead_tokens = min(rng.randint(0, 4), room) if req.num_uncomputed_tokens == 1 else 0
    out = sched.schedule()
    ended = []
    for chunk in out.chunks:
        chunk.spec_token_ids = [rng.randrange(50) for _ in range(chunk.num_lookahead)]
        if not chunk.samples:
            continue
        accepted = rng.randint(0, chunk.num_lookahead)
        chunk.num_rejected = chunk.num_lookahead - accepted
        req = chunk.req
        for token in [*chunk.spec_token_ids[:accepted], rng.randrange(50)]:
            req.append_token(token)
            if req.num_output_tokens >= req.params.max_tokens or rng.random() < 0.02:  # a stop mid-run
                ended.append(req)
                break
    sched.update(out)
    for req in ended:
        sched.finish(req, "length")
