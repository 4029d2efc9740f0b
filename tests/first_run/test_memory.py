"""Memory sized to the job (issue 23 point 2): on a CPU the KV cache defaults to what max_num_seqs x max_model_len
can use, within a share of the available memory; the swap space is allocated at the first swap-out; explicit
settings win; the start-up log says how much and why; and the budget is not resident until it is used."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.engine import Engine
from tokenfleet.engine.memory import (
    GIB,
    KV_SHARE_OF_AVAILABLE,
    SWAP_SHARE_OF_AVAILABLE,
    GpuMemory,
    Job,
    available_memory,
    plan_cpu_memory,
    plan_gpu_memory,
)
from tokenfleet.engine.request import RequestStatus, SamplingParams

BLOCK = 4096  # bytes per block in the planning tests
JOB = Job(max_num_seqs=8, max_model_len=100, block_size=16, block_bytes=BLOCK, watermark=0.0)


def test_the_automatic_kv_cache_holds_every_sequence_at_full_length():
    assert JOB.blocks_needed() == 8 * 7  # 100 tokens take 7 blocks of 16
    plan = plan_cpu_memory(JOB, None, None, available_bytes=64 * GIB)
    assert (plan.num_blocks, plan.num_host_blocks) == (56, 56)
    assert "what max_num_seqs 8 x max_model_len 100 can use" in plan.kv_reason
    assert plan.swap_reason == "as large as the KV cache"


def test_the_watermark_adds_its_headroom():
    job = Job(max_num_seqs=8, max_model_len=100, block_size=16, block_bytes=BLOCK, watermark=0.01)
    assert job.blocks_needed() == 57  # ceil(56 / 0.99)


def test_a_job_larger_than_the_memory_share_is_capped_and_says_what_to_change():
    available = 100 * BLOCK
    plan = plan_cpu_memory(JOB, None, None, available_bytes=available)
    assert plan.num_blocks == int(KV_SHARE_OF_AVAILABLE * 100) == 25
    assert plan.num_host_blocks == int(SWAP_SHARE_OF_AVAILABLE * 100) == 12
    assert plan.kv_reason.startswith("capped at 25% of") and "lower max_num_seqs or max_model_len" in plan.kv_reason
    assert plan.swap_reason.startswith("capped at 12.5% of")


def test_explicit_settings_win_over_the_job_and_the_memory():
    plan = plan_cpu_memory(JOB, kv_cache_gib=1.0, swap_space_gib=0.5, available_bytes=100 * BLOCK)
    assert (plan.num_blocks, plan.num_host_blocks) == (GIB // BLOCK, GIB // 2 // BLOCK)
    assert plan.kv_reason == "kv_cache_gib=1 as set" and plan.swap_reason == "swap_space_gib=0.5 as set"


def test_available_memory_is_read_from_the_system():
    assert 0 < available_memory() <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def engine(model_dir: Path, **options) -> Engine:
    return Engine(EngineConfig.from_options(str(model_dir), skip_tokenizer_init=True, **options))


def test_an_engine_sizes_its_cache_to_the_job_and_logs_why(demo_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="tokenfleet.engine.runner")
    e = engine(demo_model_dir, max_num_seqs=4, max_model_len=256)
    block_bytes = 16 * e.model_config.kv_bytes_per_token(e.runner.kv_dtype)
    assert e.runner.num_blocks == Job(4, 256, 16, block_bytes, 0.01).blocks_needed() == 65
    assert e.runner.num_host_blocks == e.runner.num_blocks
    assert e.runner.kv_cache.shape[3] == 65
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        line.startswith("KV cache: ")
        and "65 blocks of 16 tokens" in line
        and "max_num_seqs 4 x max_model_len 256" in line
        for line in lines
    ), lines
    assert any(line.startswith("swap space: ") and "allocated at the first swap-out" in line for line in lines), lines


def test_swap_space_is_allocated_at_the_first_swap_out(demo_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="tokenfleet.engine.runner")
    e = engine(demo_model_dir, max_num_seqs=1, max_model_len=256, swap_threshold_tokens=16, max_num_batched_tokens=64)
    assert e.runner._host_cache is None
    long = e.add_request(
        list(range(10, 40)), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), priority=5
    )
    while long.num_computed_tokens < 40:
        e.step()
    assert e.runner._host_cache is None, "nothing was swapped yet"
    urgent = e.add_request(list(range(50, 60)), SamplingParams(max_tokens=4, temperature=0.0), priority=0)
    e.step()
    assert long.status is RequestStatus.SWAPPED and urgent.status is RequestStatus.RUNNING
    assert e.runner._host_cache is not None and e.runner.host_cache.shape[3] == e.runner.num_host_blocks
    assert any(r.getMessage().startswith("swap space: allocated") for r in caplog.records)
    while e.has_unfinished():
        e.step()
    assert long.finish_reason == "length" and long.num_output_tokens == 40


def resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_large_budget_is_not_resident_until_used(demo_model_dir):
    before = resident_bytes()
    e = engine(demo_model_dir, kv_cache_gib=2.0, swap_space_gib=1.0, max_model_len=256)
    assert e.runner.host_cache.numel() > 0  # allocating the swap space commits nothing either
    grown = resident_bytes() - before
    assert e.runner.num_blocks * 16 * e.model_config.kv_bytes_per_token(e.runner.kv_dtype) >= 2 * GIB - 2**20
    assert grown < 300 * 2**20, f"an idle engine with a 3 GiB budget grew by {grown / 2**20:.0f} MiB"


GPU = GpuMemory(total_bytes=100 * GIB, free_bytes=90 * GIB, engine_bytes=3 * GIB)


def test_a_gpu_kv_cache_takes_the_utilization_less_the_engines_own_memory():
    """vLLM's meaning: gpu_memory_utilization is the engine's whole share, so two engines at 0.4 fit one GPU."""
    plan = plan_gpu_memory(GPU, block_bytes=GIB // 4, utilization=0.4, kv_cache_gib=None, swap_space_gib=0.5)
    assert plan.num_blocks == (40 - 3) * 4 and plan.num_host_blocks == 2
    second = GpuMemory(total_bytes=100 * GIB, free_bytes=60 * GIB - 1, engine_bytes=3 * GIB)
    assert plan_gpu_memory(second, GIB // 4, 0.4, None, None).num_blocks == 37 * 4


def test_a_gpu_kv_cache_that_would_not_fit_in_free_memory_is_refused_at_start():
    with pytest.raises(ValueError, match="only 90.00 GiB of the GPU is free"):
        plan_gpu_memory(GPU, GIB // 4, utilization=0.95, kv_cache_gib=None, swap_space_gib=None)
    with pytest.raises(ValueError, match="kv_cache_gib=91 as set"):
        plan_gpu_memory(GPU, GIB // 4, utilization=0.1, kv_cache_gib=91, swap_space_gib=None)
    assert plan_gpu_memory(GPU, GIB // 4, utilization=0.1, kv_cache_gib=2, swap_space_gib=None).num_blocks == 8
