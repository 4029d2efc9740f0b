"""Tensor parallelism on CPU (gloo): tensor_parallel_size 2 splits the model over this process and one worker
process, each rank holding and reading only its half of the checkpoint, and its greedy output is size 1's (alone,
in a chunked batch, with swaps, prefix hits and a cancel); bad sizes are refused at start; a rank killed with
SIGKILL, or one that hangs, fails the step's requests within seconds and leaves the engine dead, never hung."""

from __future__ import annotations

import argparse
import os
import random
import signal
import time
from pathlib import Path

import pytest
import safetensors
import torch

from tests.checkpoints import ARCHITECTURES, SMALL_KV, make_checkpoint
from tests.servers import descendants
from tokenfleet import LLM, SamplingParams
from tokenfleet.engine import tensor_parallel
from tokenfleet.engine.config import EngineConfig, add_engine_arguments, engine_config_from_args
from tokenfleet.engine.engine import Engine
from tokenfleet.engine.runner import ModelRunner
from tokenfleet.model import loader
from tokenfleet.model.config import ModelConfig
from tokenfleet.model.loader import load_model
from tokenfleet.model.parallel import TensorShard, parameter_bytes

CHECKPOINTS = ["demo", *sorted(ARCHITECTURES)]


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request, tmp_path_factory) -> Path:
    if request.param == "demo":
        return request.getfixturevalue("demo_model_dir")
    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def random_prompts(count: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy(n) for n in max_tokens])
    assert all(o.finish_reason == "length" and o.error is None for o in outputs)
    return [o.token_ids for o in outputs]


def tp_llm(path: Path, **options) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, tensor_parallel_size=2, **{**SMALL_KV, **options})


def close(llm: LLM) -> None:
    group = llm.engine.tensor_parallel
    assert group is not None
    pids = group.worker_pids
    group.close()
    for pid in pids:  # the worker is gone (reaped by close), not left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_greedy_output_equals_size_1_alone_and_in_a_chunked_batch(checkpoint):
    vocab = ModelConfig.from_dir(checkpoint).vocab_size
    alone = random_prompts(3, 1, 40, vocab, seed=1)
    batch = random_prompts(6, 3, 70, vocab, seed=2)
    lengths = [random.Random(i).randint(4, 12) for i in range(len(batch))]
    whole = LLM(str(checkpoint), skip_tokenizer_init=True, **SMALL_KV)
    expected_alone = [generate(whole, [p], [10])[0] for p in alone]
    expected_batch = generate(whole, batch, lengths)
    # a small token budget: prompts are prefilled in chunks, beside other requests' decodes
    split = tp_llm(checkpoint, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        assert split.engine.runner.num_blocks > 0 and split.engine.tensor_parallel is not None
        assert [generate(split, [p], [10])[0] for p in alone] == expected_alone
        assert generate(split, batch, lengths) == expected_batch
        assert split.engine.blocks.num_free_blocks == split.engine.blocks.num_blocks
        assert split.engine.dead is None
    finally:
        close(split)


def test_prefix_hit_and_swap_preemption_match_size_1(demo_model_dir):
    """Swap copies go to every rank's cache; a prefix-cache hit reuses every rank's blocks."""
    vocab = 4096
    prompts = random_prompts(6, 20, 40, vocab, seed=4)
    shared = random_prompts(1, 40, 40, vocab, seed=5)[0]
    # 12 blocks of the whole model's size hold 12 x 16 tokens: 6 requests of up to 60 tokens must preempt
    block_bytes = 16 * 2 * 2 * 2 * 16 * 4
    options = dict(watermark=0.0, swap_threshold_tokens=16, swap_space_gib=SMALL_KV["swap_space_gib"])
    whole = LLM(str(demo_model_dir), skip_tokenizer_init=True, kv_cache_gib=12 * block_bytes / (1 << 30), **options)
    expected = generate(whole, prompts, [20] * 6)
    expected_shared = [generate(whole, [shared + [7, 8]], [6])[0], generate(whole, [shared + [9]], [6])[0]]
    # a rank's block holds half the heads: the same bytes hold twice the blocks, so give it half the bytes
    split = tp_llm(demo_model_dir, kv_cache_gib=6 * block_bytes / (1 << 30), **options)
    try:
        assert split.engine.blocks.num_blocks == 12
        preempted = []
        original = split.engine.scheduler._preempt

        def spy(req, out):
            refund = original(req, out)
            preempted.append(req.status.name)
            return refund

        split.engine.scheduler._preempt = spy
        assert generate(split, prompts, [20] * 6) == expected
        assert "SWAPPED" in preempted, f"no swap happened: {preempted}"
        first = generate(split, [shared + [7, 8]], [6])[0]
        outputs = split.generate({"prompt_token_ids": shared + [9]}, greedy(6))
        assert [first, outputs[0].token_ids] == expected_shared
        assert outputs[0].num_cached_tokens == 32
    finally:
        close(split)


class _NoCollectives:
    """Loading a shard needs no communication."""

    rank = 0
    world_size = 2

    def all_reduce(self, tensor: torch.Tensor) -> None:
        raise AssertionError("no collective while loading")

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        raise AssertionError("no collective while loading")


@pytest.mark.parametrize("arch", ["demo", "llama", "qwen2"])
def test_each_rank_holds_and_reads_about_half_the_weights(arch, demo_model_dir, tmp_path, monkeypatch):
    path = demo_model_dir if arch == "demo" else make_checkpoint(tmp_path, arch)
    whole = parameter_bytes(load_model(path))
    file_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    read: list[int] = []

    class CountingFile:  # every byte a rank reads from the safetensors file, whole tensors and slices alike
        def __init__(self, *args, **kwargs) -> None:
            self.file = safetensors.safe_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            return counted(self.file.get_tensor(name))

        def get_slice(self, name):
            view = self.file.get_slice(name)

            class Slice:
                def get_shape(self):
                    return view.get_shape()

                def __getitem__(self, index):
                    return counted(view[index])

            return Slice()

    def counted(tensor: torch.Tensor) -> torch.Tensor:
        read.append(tensor.numel() * tensor.element_size())
        return tensor

    monkeypatch.setattr(loader, "safe_open", CountingFile)
    for rank in (0, 1):
        read.clear()
        shard = load_model(path, shard=(TensorShard(rank, 2), _NoCollectives()))
        held = parameter_bytes(shard)
        # attention, MLP, embedding and LM head are split; the norms (a few hundred bytes) are held whole
        assert held < 0.55 * whole, f"rank {rank} holds {held} of {whole} bytes"
        assert sum(read) < 0.55 * file_bytes, f"rank {rank} read {sum(read)} of {file_bytes} bytes"


def test_bad_sizes_are_refused_at_start(demo_model_dir):
    # the demo "tiny" model: 4 attention heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide the model's 4 attention heads"):
        Engine(EngineConfig(str(demo_model_dir), tensor_parallel_size=3, **SMALL_KV))
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 does not divide the model's 2 KV heads") as e:
        Engine(EngineConfig(str(demo_model_dir), tensor_parallel_size=4, **SMALL_KV))
    assert "4 attention heads" in str(e.value)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be an integer of at least 1, got 0"):
        EngineConfig(str(demo_model_dir), tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"speculative_config is not supported with tensor_parallel_size 2"):
        Engine(EngineConfig(str(demo_model_dir), tensor_parallel_size=2, speculative_config={"method": "ngram"}))


def test_the_flag_and_size_1_keeps_todays_path(demo_model_dir):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--model", str(demo_model_dir), "--tensor-parallel-size", "2"])
    assert engine_config_from_args(args).tensor_parallel_size == 2
    engine = Engine(EngineConfig(str(demo_model_dir), skip_tokenizer_init=True, **SMALL_KV))
    assert engine.tensor_parallel is None and engine.dead is None
    assert type(engine.runner) is ModelRunner
    assert engine.model.gather_logits is None


def test_a_killed_rank_fails_the_next_step_instead_of_hanging(demo_model_dir):
    llm = tp_llm(demo_model_dir)
    engine, group = llm.engine, llm.engine.tensor_parallel
    assert group is not None
    noticed: list[tuple[str, float]] = []
    group.on_lost = lambda reason: noticed.append((reason, time.monotonic()))
    try:
        engine.add_request([5, 6, 7, 8], greedy(50), request_id="before")
        first = engine.step()
        assert first[0].error is None and len(first[0].new_token_ids) == 1
        killed = time.monotonic()
        os.kill(group.worker_pids[0], signal.SIGKILL)
        time.sleep(0.5)  # the engine is idle: its watcher notices anyway
        assert [reason for reason, _ in noticed] == [engine.dead] and noticed[0][1] - killed < 0.5
        assert engine.dead is not None and "exited with code -9" in engine.dead
        started = time.monotonic()
        outputs = []
        while engine.has_unfinished() and time.monotonic() - started < 10:
            outputs += engine.step()
        assert time.monotonic() - started < 5, "the step did not fail within seconds"
        assert [(o.request_id, o.finished, o.finish_reason) for o in outputs[-1:]] == [("before", True, "error")]
        assert "tensor-parallel rank 1" in (outputs[-1].error or "")
        assert engine.dead is not None and "rank 1" in engine.dead
        # the engine stays dead: a new request fails at its first step, and nothing leaks
        engine.add_request([9, 10], greedy(4), request_id="after")
        after = engine.step()
        assert [(o.request_id, o.finish_reason) for o in after] == [("after", "error")]
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    finally:
        group.close()


def test_a_hung_rank_fails_the_step_after_the_collective_timeout(demo_model_dir, monkeypatch):
    monkeypatch.setattr(tensor_parallel, "COLLECTIVE_TIMEOUT_S", 2.0)  # rank 0's wait for its peers in a collective
    llm = tp_llm(demo_model_dir)
    engine, group = llm.engine, llm.engine.tensor_parallel
    assert group is not None
    pid = group.worker_pids[0]
    try:
        engine.add_request([5, 6, 7, 8], greedy(50), request_id="hung")
        assert engine.step()[0].error is None
        os.kill(pid, signal.SIGSTOP)  # alive, but it never answers
        started = time.monotonic()
        outputs = engine.step()
        assert time.monotonic() - started < 2.0 + tensor_parallel.EXIT_SHOWS_S + 2.0
        assert [(o.request_id, o.finish_reason) for o in outputs] == [("hung", "error")]
        assert engine.dead is not None and "a tensor-parallel step failed" in engine.dead
        with pytest.raises(ProcessLookupError):  # the hung rank was killed, not left stopped
            os.kill(pid, 0)
    finally:
        group.close()


def worker_children(pid: int) -> list[int]:
    pids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in pids if b"tokenfleet.engine.tp_worker" in Path(f"/proc/{c}/cmdline").read_bytes()]


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)]
        if not alive:
            return True
        time.sleep(0.05)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"


def test_in_an_engine_process_and_no_orphan_ranks_when_it_dies(demo_model_dir):
    """What servers run: the engine process (a daemon) is rank 0 and starts its worker as a plain subprocess; when
    the engine process is killed, the worker sees its pipe close and exits."""
    import asyncio

    from tokenfleet.engine.engine_process import EngineProcess

    prompts = ["The list of", "Once upon a time there"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.text for o in LLM(str(demo_model_dir), **SMALL_KV).generate(prompts, params)]
    engine = EngineProcess(EngineConfig.from_options(str(demo_model_dir), tensor_parallel_size=2, **SMALL_KV))
    try:

        async def run_all() -> list[str]:
            async def one(prompt: str) -> str:
                return [o async for o in engine.generate(prompt, params)][-1].text

            return list(await asyncio.gather(*(one(p) for p in prompts)))

        assert asyncio.run(run_all()) == expected
        workers = worker_children(engine._process.pid)
        assert len(workers) == 1
        os.kill(engine._process.pid, signal.SIGKILL)
        assert gone_within(workers, 5.0), "the worker rank outlived its engine process"
    finally:
        engine.shutdown()


def test_cancel_mid_batch_leaves_the_others_as_size_1(demo_model_dir):
    prompts = random_prompts(3, 10, 30, 4096, seed=6)
    expected = generate(LLM(str(demo_model_dir), skip_tokenizer_init=True, **SMALL_KV), prompts, [12] * 3)
    split = tp_llm(demo_model_dir, max_num_batched_tokens=16)
    engine = split.engine
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, greedy(12), request_id=str(i))
        tokens: dict[str, list[int]] = {"0": [], "1": [], "2": []}
        for step in range(200):
            if step == 4:
                assert engine.abort("1")
            for out in engine.step():
                assert out.error is None and (step < 4 or out.request_id != "1")
                tokens[out.request_id] += out.new_token_ids
            if not engine.has_unfinished():
                break
        assert [tokens["0"], tokens["2"]] == [expected[0], expected[2]]
        assert len(tokens["1"]) < 12
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    finally:
        close(split)


def test_a_replica_whose_rank_dies_reports_itself_unhealthy(demo_model_dir, tmp_path):
    import httpx

    from tests.gateway.conftest import replica_args
    from tests.servers import free_port, running_process

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = [*replica_args(demo_model_dir, port), "--tensor-parallel-size", "2"]
    with running_process(args, f"{base}/health", tmp_path / "replica.log") as proc:
        assert httpx.get(f"{base}/health").status_code == 200
        workers = [
            p
            for p in descendants(proc.pid)
            if b"tokenfleet.engine.tp_worker" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        assert len(workers) == 1, "one worker process besides rank 0"
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{base}/health").status_code == 200:
            assert time.monotonic() < deadline, "the replica still says it is healthy with a rank gone"
            time.sleep(0.1)
        assert httpx.get(f"{base}/health").status_code == 503


def test_more_ranks_than_gpus_is_refused_at_start(demo_model_dir, monkeypatch):
    """On CUDA each rank takes a GPU of its own: asking for more ranks than the machine has GPUs fails at start,
    saying how many there are (checked here without a GPU: the check reads torch.cuda.device_count)."""
    config = EngineConfig(str(demo_model_dir), tensor_parallel_size=2, **SMALL_KV)
    model_config = ModelConfig.from_dir(demo_model_dir)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 needs 2 GPUs \(one per rank\); this machine has 1"):
        tensor_parallel.check_tensor_parallel(config, model_config, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    tensor_parallel.check_tensor_parallel(config, model_config, torch.device("cuda"))  # enough GPUs: no refusal
