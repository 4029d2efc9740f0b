"""Sampler: greedy, seeded reproducibility, distributions, truncation, penalties, min_tokens, logprobs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tokenfleet.engine.request import Request, SamplingParams
from tokenfleet.engine.sampler import PromptTokenCache, Sampler, apply_penalties, apply_top_p

EOS = 9
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make(params: SamplingParams, prompt: list[int] | None = None, outputs: list[int] = (), name: str = "r") -> Request:
    req = Request(name, list(prompt or [1, 2, 3]), params)
    for t in outputs:
        req.append_token(t)
    return req


def row_logits(key: int, step: int, vocab: int) -> torch.Tensor:
    """A deterministic logits row for (request key, step), independent of any batch."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(key * 1000 + step))


def chi_square(samples: list[int], probs: torch.Tensor) -> float:
    counts = Counter(samples)
    n = len(samples)
    return sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in enumerate(probs.tolist()))


# Upper 0.999 quantile of chi-square with 5 degrees of freedom.
CHI2_5DF_999 = 20.52


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device: str) -> None:
    logits = torch.randn(6, 100, device=device)
    reqs = [make(SamplingParams(temperature=0.0)) for _ in range(6)]
    out = Sampler({EOS})(logits, reqs)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_rows_stay_argmax_next_to_other_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 100)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.7, top_p=0.5, seed=3),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler({EOS})(logits, [make(p) for p in params])
    expected = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]


def test_caller_logits_are_not_modified() -> None:
    logits = torch.randn(3, 50)
    before = logits.clone()
    reqs = [
        make(
            SamplingParams(
                temperature=0.8,
                top_p=0.5,
                top_k=5,
                min_p=0.1,
                repetition_penalty=1.3,
                frequency_penalty=0.5,
                min_tokens=3,
                stop_token_ids=[4],
            ),
            outputs=[5, 5],
        )
        for _ in range(3)
    ]
    Sampler({EOS})(logits, reqs)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("seed", [None, 5])
def test_top_k_1_and_tiny_top_p_are_greedy(seed: int | None) -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 300)
    params = [SamplingParams(temperature=1.0, top_k=1, seed=seed)] * 4 + [
        SamplingParams(temperature=1.5, top_p=1e-6, seed=seed)
    ] * 4
    out = Sampler({EOS})(logits, [make(p) for p in params])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def _run_steps(batch: list[tuple[int, Request]], steps: int, vocab: int) -> None:
    """Decode `steps` tokens for every (key, request), each row's logits depending only on its key and step."""
    sampler = Sampler({EOS})
    for step in range(steps):
        logits = torch.stack([row_logits(key, step, vocab) for key, _ in batch])
        for (_, req), token in zip(batch, sampler(logits, [r for _, r in batch]).token_ids):
            req.append_token(token)


TARGETS = {
    101: SamplingParams(temperature=1.0, seed=11),
    102: SamplingParams(temperature=0.8, top_p=0.9, seed=12),
    103: SamplingParams(temperature=1.2, top_k=20, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5, seed=13),
}


def _fresh_targets() -> dict[int, Request]:
    return {key: make(p, name=f"t{key}") for key, p in TARGETS.items()}


def _other_rows() -> list[tuple[int, Request]]:
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_p=0.8, seed=99),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=3),
        SamplingParams(temperature=0.9, top_k=3),
    ]
    return [(key, make(p, name=f"o{key}")) for key, p in enumerate(params, start=1)]


def test_seeded_tokens_do_not_depend_on_the_batch() -> None:
    vocab, steps = 2000, 12
    alone = {}
    for key, req in _fresh_targets().items():
        _run_steps([(key, req)], steps, vocab)
        alone[key] = req.output_token_ids
    assert len({tuple(v) for v in alone.values()}) == 3

    for layout in ([0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0], [3, 0, 6, 1, 7, 2, 5, 4]):
        targets = _fresh_targets()
        pool = _other_rows() + list(targets.items())
        _run_steps([pool[i] for i in layout], steps, vocab)
        assert {k: r.output_token_ids for k, r in targets.items()} == alone


def test_different_seeds_give_different_tokens_and_same_seed_repeats() -> None:
    def sequence(seed: int) -> list[int]:
        req = make(SamplingParams(temperature=1.0, seed=seed))
        _run_steps([(7, req)], 10, 1000)
        return req.output_token_ids

    assert sequence(1) != sequence(2)
    assert sequence(1) == sequence(1)


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_unseeded_frequencies_match_softmax(temperature: float) -> None:
    torch.manual_seed(1234)
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -2.0])
    n = 6000
    reqs = [make(SamplingParams(temperature=temperature)) for _ in range(n)]
    out = Sampler({EOS})(base.repeat(n, 1), reqs)
    assert chi_square(out.token_ids, torch.softmax(base / temperature, dim=0)) < CHI2_5DF_999


def test_seeded_frequencies_match_softmax() -> None:
    base = torch.tensor([1.5, 1.0, 0.2, 0.0, -0.5, -1.5])
    n = 3000
    reqs = [make(SamplingParams(temperature=0.9, seed=s)) for s in range(n)]
    out = Sampler({EOS})(base.repeat(n, 1), reqs)
    assert chi_square(out.token_ids, torch.softmax(base / 0.9, dim=0)) < CHI2_5DF_999


PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (dict(top_k=3), {0, 1, 2}),
        (dict(top_p=0.6), {0, 1}),
        (dict(top_p=0.7), {0, 1, 2}),
        (dict(min_p=0.3), {0, 1, 2}),
        (dict(min_p=0.5), {0, 1}),
        (dict(top_k=3, top_p=0.7), {0, 1}),  # top_p works on the top_k-renormalized distribution
        (dict(top_k=4, min_p=0.5), {0, 1}),
    ],
)
@pytest.mark.parametrize("seeded", [False, True])
def test_truncation_never_picks_excluded_tokens(params: dict, allowed: set[int], seeded: bool) -> None:
    torch.manual_seed(7)
    n = 1500
    logits = torch.tensor(PROBS).log().repeat(n, 1)
    reqs = [make(SamplingParams(temperature=1.0, seed=i if seeded else None, **params)) for i in range(n)]
    assert set(Sampler({EOS})(logits, reqs).token_ids) == allowed


def reference_top_p(row: torch.Tensor, top_p: float) -> torch.Tensor:
    probs = torch.softmax(row.double(), dim=0)
    order = probs.argsort(descending=True).tolist()
    keep, mass = [], 0.0
    for t in order:
        if mass >= top_p:
            break
        keep.append(t)
        mass += probs[t].item()
    mask = torch.zeros_like(row, dtype=torch.bool)
    mask[keep] = True
    return mask


@pytest.mark.parametrize("scale", [8.0, 0.05])  # peaked: nucleus among the candidates; flat: full-sort fallback
def test_top_p_matches_reference(scale: float) -> None:
    torch.manual_seed(3)
    x = torch.randn(4, 3000) * scale
    ps = [0.3, 0.9, 0.5, 0.99]
    masked = x.clone()
    apply_top_p(masked, ps)
    for row, p in enumerate(ps):
        kept = masked[row] > float("-inf")
        assert torch.equal(kept, reference_top_p(x[row], p))
        assert torch.equal(masked[row][kept], x[row][kept])


def reference_penalties(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    out = logits.clone()
    for i, req in enumerate(reqs):
        p = req.params
        for t in set(req.prompt_token_ids) | set(req.output_token_ids):
            v = out[i, t].item()
            out[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t, count in Counter(req.output_token_ids).items():
            out[i, t] -= p.frequency_penalty * count + p.presence_penalty
    return out


@pytest.mark.parametrize("cached_prompts", [False, True])
def test_penalties_match_reference(cached_prompts: bool) -> None:
    torch.manual_seed(5)
    logits = torch.randn(6, 30) * 2
    reqs = [
        make(SamplingParams(repetition_penalty=1.3), prompt=[1, 2, 2, 29], outputs=[3, 3, 0]),
        make(SamplingParams(frequency_penalty=0.7), prompt=[4, 5], outputs=[5, 6, 6, 6]),
        make(SamplingParams(presence_penalty=-0.4), prompt=[7], outputs=[8, 8, 9]),
        make(SamplingParams(), prompt=[1, 2], outputs=[1, 1]),
        make(
            SamplingParams(repetition_penalty=0.8, frequency_penalty=0.3, presence_penalty=1.1),
            prompt=[10, 11, 12, 12],
            outputs=[12, 13, 13, 10],
        ),
        make(SamplingParams(presence_penalty=1.0, repetition_penalty=1.2), prompt=[14, 15], outputs=[]),
    ]
    x = logits.clone()
    prompts = PromptTokenCache() if cached_prompts else None
    apply_penalties(x, reqs, prompts)
    torch.testing.assert_close(x, reference_penalties(logits, reqs))
    if prompts is not None:  # a second step reuses the cached prompts
        x = logits.clone()
        apply_penalties(x, reqs, prompts)
        torch.testing.assert_close(x, reference_penalties(logits, reqs))


def test_greedy_with_penalties_picks_the_reference_argmax() -> None:
    logits = torch.tensor([[5.0, 4.8, 1.0, 0.0], [5.0, 3.0, -1.0, 3.9], [-0.5, -0.6, -3.0, -4.0]])
    reqs = [
        make(SamplingParams(temperature=0.0, repetition_penalty=1.1), prompt=[0]),
        make(SamplingParams(temperature=0.0, frequency_penalty=0.6), prompt=[2], outputs=[0, 0]),
        make(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[0]),
    ]
    out = Sampler({EOS})(logits, reqs)
    assert out.token_ids == reference_penalties(logits, reqs).argmax(dim=-1).tolist() == [1, 3, 1]


def _eos_favoured_logits(n: int) -> torch.Tensor:
    logits = torch.zeros(n, 10)
    logits[:, EOS] = 10.0
    logits[:, 8] = 9.0
    logits[:, 5] = 8.0
    return logits


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    req = make(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[8]))
    sampler = Sampler({EOS})
    tokens = []
    for _ in range(3):
        token = sampler(_eos_favoured_logits(1), [req]).token_ids[0]
        req.append_token(token)
        tokens.append(token)
    assert tokens == [5, 5, EOS]


def test_min_tokens_masks_when_sampling() -> None:
    torch.manual_seed(0)
    n = 500
    reqs = [make(SamplingParams(temperature=5.0, min_tokens=1, stop_token_ids=[8])) for _ in range(n)]
    tokens = set(Sampler({EOS})(_eos_favoured_logits(n), reqs).token_ids)
    assert not tokens & {8, EOS}
    assert len(tokens) > 3


def test_min_tokens_with_ignore_eos_masks_only_stop_tokens() -> None:
    # As in vLLM: with ignore_eos, eos is not a stop token, so min_tokens has no reason to hide it.
    req = make(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[8], ignore_eos=True))
    assert Sampler({EOS})(_eos_favoured_logits(1), [req]).token_ids == [EOS]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_come_from_raw_logits(device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    logits = (torch.randn(4, 64) * 3).to(device=device, dtype=dtype)
    reqs = [
        make(SamplingParams(temperature=0.7, top_p=0.8, repetition_penalty=1.4, logprobs=5), outputs=[1, 2]),
        make(SamplingParams(temperature=0.0, logprobs=0, frequency_penalty=1.0), outputs=[3]),
        make(SamplingParams(temperature=1.0)),
        make(SamplingParams(temperature=0.0, logprobs=20, seed=4)),
    ]
    out = Sampler({EOS})(logits, reqs)
    raw = torch.log_softmax(logits.float().cpu(), dim=-1)
    assert out.logprobs[2] is None
    for i, n in [(0, 5), (1, 0), (3, 20)]:
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-5)
        assert len(lp.top) == n
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert {t for t, _ in lp.top} == set(raw[i].topk(n).indices.tolist())
        for t, v in lp.top:
            assert v == pytest.approx(raw[i, t].item(), abs=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_logits(device: str) -> None:
    torch.manual_seed(9)
    logits = (torch.randn(6, 500) * 2).to(device=device, dtype=torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.0, min_tokens=1),
        SamplingParams(temperature=0.8, top_k=10, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.2, presence_penalty=0.5),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler({EOS})(logits, [make(p, outputs=[4]) for p in params])
    expected = logits.float().argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (0, 5)] == [expected[i] for i in (0, 5)]
    assert all(isinstance(t, int) and 0 <= t < 500 for t in out.token_ids)
    top10 = set(logits[2].float().topk(10).indices.tolist())
    assert out.token_ids[2] in top10


def test_rejects_mismatched_batch() -> None:
    with pytest.raises(ValueError):
        Sampler({EOS})(torch.zeros(2, 10), [make(SamplingParams())])


def test_large_vocab_seeded_top_p_is_reproducible() -> None:
    """Past the top_p candidate window (flat logits, big nucleus) seeded sampling still repeats exactly."""
    logits = torch.randn(3, 20000, generator=torch.Generator().manual_seed(0)) * 0.1

    def run() -> list[int]:
        reqs = [make(SamplingParams(temperature=1.0, top_p=0.95, seed=s)) for s in (1, 2, 3)]
        return Sampler({EOS})(logits, reqs).token_ids

    first = run()
    assert first == run()
    assert all(0 <= t < 20000 for t in first)
