from __future__ import annotations

import random

from tokenfleet.engine.kv_blocks import prefix_block_hashes
from tokenfleet.router.prefix import DEFAULT_MAX_BLOCKS, PrefixIndex, prompt_hashes


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32_000) for _ in range(n)]


def test_prompt_hashes_are_the_engines_keys_capped_to_the_leading_blocks() -> None:
    prompt = tokens(16 * DEFAULT_MAX_BLOCKS + 100)
    engine_keys = prefix_block_hashes(prompt, 16)
    assert prompt_hashes(prompt, 16) == engine_keys[:DEFAULT_MAX_BLOCKS]
    assert prompt_hashes(prompt, 16, max_blocks=None) == engine_keys
    assert prompt_hashes(prompt[:40], 16) == engine_keys[:2]  # only full blocks
    assert prompt_hashes(prompt[:15], 16) == []


def test_matches_counts_leading_blocks_and_stops_at_the_first_block_nobody_has() -> None:
    index = PrefixIndex()
    prompt = prompt_hashes(tokens(16 * 10), 16)
    index.record(prompt[:6], "a")
    index.record(prompt[:3], "b")
    assert index.matches(prompt) == {"a": 6, "b": 3}
    other = prompt_hashes(tokens(16 * 10, seed=1), 16)
    assert index.matches(other) == {}
    # Chained keys: a replica that holds block k holds every block before it, even if it is not listed there.
    small = PrefixIndex(replicas_per_block=1)
    small.record(prompt[:2], "a")
    small.record(prompt[:5], "b")  # b replaces a on blocks 0-1
    small.record(prompt[:2], "c")  # c replaces b on blocks 0-1; b stays on 2-4
    assert small.matches(prompt) == {"c": 2, "b": 5}


def test_matches_is_each_replicas_deepest_listed_block_of_the_matched_prefix() -> None:
    """matches walks runs of blocks with the same holders; it must equal the definition block by block, whatever
    the holders do along the prompt (change, come back, stop before a gap)."""
    prompts = [prompt_hashes(tokens(16 * 30, seed=s), 16) for s in range(3)]
    rng = random.Random(7)
    for _ in range(200):
        index = PrefixIndex(max_entries=60, replicas_per_block=rng.choice([1, 2, 4]))
        for _ in range(rng.randrange(1, 12)):
            prompt = rng.choice(prompts)
            index.record(prompt[: rng.randrange(1, 31)], rng.choice("abcde"))
        for prompt in prompts:
            expected: dict[str, int] = {}
            for depth, key in enumerate(prompt, start=1):
                if not index.holders(key):
                    break
                expected.update(dict.fromkeys(index.holders(key), depth))
            assert index.matches(prompt) == expected


def test_keeps_the_newest_few_replicas_per_block() -> None:
    index = PrefixIndex(replicas_per_block=2)
    prompt = prompt_hashes(tokens(32), 16)
    for replica in ("a", "b", "c", "b"):
        index.record(prompt, replica)
    assert index.holders(prompt[0]) == ["b", "c"]
    assert index.matches(prompt) == {"b": 2, "c": 2}


def test_size_stays_bounded_and_the_least_recently_used_go_first() -> None:
    index = PrefixIndex(max_entries=50)
    old = prompt_hashes(tokens(16 * 20, seed=1), 16)
    index.record(old, "a")
    for seed in range(2, 6):
        index.record(prompt_hashes(tokens(16 * 10, seed=seed), 16), "b")
    assert len(index) == 50
    # 60 entries went in: the 10 evicted are the old prompt's deepest blocks, so its leading blocks still match.
    assert index.matches(old) == {"a": 10}
    index.record(prompt_hashes(tokens(16 * 50, seed=9), 16), "c")
    assert len(index) == 50 and index.matches(old) == {}


def test_forget_drops_a_replica_everywhere() -> None:
    index = PrefixIndex()
    prompt = prompt_hashes(tokens(16 * 4), 16)
    index.record(prompt, "a")
    index.record(prompt[:2], "b")
    index.forget("a")
    assert index.matches(prompt) == {"b": 2}
    assert len(index) == 2  # blocks only "a" held are gone
    index.forget("b")
    assert len(index) == 0


def test_continuations_count_how_many_ways_prompts_went_on_after_a_block() -> None:
    index = PrefixIndex()
    system = tokens(16 * 3)
    first, second = prompt_hashes(system + tokens(32, seed=1), 16), prompt_hashes(system + tokens(32, seed=2), 16)
    index.record(first[:3], "a")
    assert index.continuations(first[2]) == 0
    index.record(first, "a")
    index.record(first, "b")  # the same continuation again
    assert index.continuations(first[2]) == 1
    index.record(second, "c")
    assert index.continuations(first[2]) == 2
    assert index.continuations(first[0]) == 1 and index.continuations(b"unknown") == 0
