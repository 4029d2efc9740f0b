"""Turns a scheduler decision into the step's tensors, moves swapped blocks, and runs the model."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.memory import (
    CUDA_CONTEXT_BYTES,
    GpuMemory,
    Job,
    MemoryPlan,
    available_memory,
    lazily_zeroed,
    plan_cpu_memory,
    plan_gpu_memory,
)
from tokenfleet.engine.prefault import CachePrefaulter
from tokenfleet.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenfleet.engine.step_inputs import InputBuilder, StepInputs
from tokenfleet.model.attention import AttentionMetadata, PagedAttention, PrefillChunk
from tokenfleet.model.cpu_kernels import advise_huge_pages, decode_kernel_build
from tokenfleet.model.kv_quant import KVScales, as_bytes, is_fp8, kv_cache_dtype, scale_for
from tokenfleet.model.llama import MLP, LlamaForCausalLM, RMSNorm

if TYPE_CHECKING:
    from tokenfleet.engine.draft import DraftModel

log = logging.getLogger(__name__)
GIB = 1 << 30
PREFAULT_AHEAD_BYTES = 256 << 20  # of KV cache faulted in while idle, past what is in use (engine/prefault.py)
CALIBRATION_TOKENS = 256  # one prefill of this many fixed pseudo-random tokens sets an 8-bit cache's scales
DecodeKernel = Callable[..., torch.Tensor]  # a fused paged decode attention op (see model/cpu_kernels.py)


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, config: EngineConfig, device: torch.device, draft: DraftModel | None = None
    ) -> None:
        self.model, self.device, self.block_size = model, device, config.block_size
        self.draft = draft  # speculative decoding's draft model, whose KV cache shares this one's blocks
        self.last_prepare_s = 0.0  # time the last execute() spent on swaps and building inputs
        self.dtype = next(model.parameters()).dtype
        self._kernel_build: Future[DecodeKernel | None] | None = None  # the CPU kernel while it compiles
        self._kernel_wait_started = time.monotonic()
        self.use_decode_kernel(None)
        if device.type == "cpu":
            self._take_kernel_when_built(decode_kernel_build())
        cfg = model.config
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        # before the cache takes the GPU's free memory: calibration needs activations
        self.kv_scales = self._calibrate_kv_scales(config) if is_fp8(self.kv_dtype) else None
        bytes_per_block = config.block_size * cfg.kv_bytes_per_token(self.kv_dtype)
        if draft is not None:  # one budget for both caches: a block id holds a token's KV in each
            bytes_per_block += draft.bytes_per_block(config.block_size)
        plan = self._memory_plan(config, bytes_per_block)
        self.num_blocks, self.num_host_blocks = plan.num_blocks, plan.num_host_blocks
        self.kv_cache_tokens = self.num_blocks * config.block_size
        # layout inside a block: see model/attention.py
        self.block_shape = (cfg.num_layers, 2, cfg.num_kv_heads, config.block_size * cfg.head_dim)
        self.kv_cache = self._device_cache()
        self._host_cache: torch.Tensor | None = None  # the swap space, allocated at the first swap-out
        if draft is not None:
            draft.allocate(self.num_blocks, self.num_host_blocks)
        self.prefaulter = self._prefaulter(config, bytes_per_block) if device.type == "cpu" else None
        kv_dtype = str(self.kv_dtype).removeprefix("torch.")
        log.info(
            "KV cache: %.2f GiB, %d blocks of %d tokens = %d tokens (%s): %s",
            self.num_blocks * bytes_per_block / GIB,
            self.num_blocks,
            config.block_size,
            self.kv_cache_tokens,
            kv_dtype,
            plan.kv_reason,
        )
        log.info(
            "swap space: %.2f GiB of host memory, %d blocks (%s), allocated at the first swap-out",
            self.num_host_blocks * bytes_per_block / GIB,
            self.num_host_blocks,
            plan.swap_reason,
        )

    def _memory_plan(self, config: EngineConfig, bytes_per_block: int) -> MemoryPlan:
        """On CPU: sized to the job within the available memory (engine/memory.py). On a GPU: the KV cache takes
        gpu_memory_utilization of the device, the swap space swap_space_gib (else 1 GiB) of host memory."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            gpu = GpuMemory(total, free, self._engine_bytes(config))
            plan = plan_gpu_memory(
                gpu, bytes_per_block, config.gpu_memory_utilization, config.kv_cache_gib, config.swap_space_gib
            )
            self._check_blocks(plan.num_blocks * bytes_per_block, bytes_per_block)
            return plan
        job = Job(
            config.max_num_seqs,
            config.max_model_len or self.model.config.max_model_len,
            config.block_size,
            bytes_per_block,
            config.watermark,
        )
        plan = plan_cpu_memory(job, config.kv_cache_gib, config.swap_space_gib, available_memory())
        requested = config.kv_cache_gib * GIB if config.kv_cache_gib is not None else plan.num_blocks * bytes_per_block
        self._check_blocks(requested, bytes_per_block)
        return plan

    def _engine_bytes(self, config: EngineConfig) -> int:
        """The weights this engine holds (its draft's too), plus a bound on one step's activations: a chunk of
        max_num_batched_tokens through the widest layer, and fp32 logits for max_num_seqs rows (with the
        sampler's copy). Measured memory would count other engines in this process too."""
        models = [self.model] + ([self.draft.model] if self.draft is not None else [])
        weights = sum(t.numel() * t.element_size() for m in models for t in [*m.parameters(), *m.buffers()])
        cfg = self.model.config
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        widest = max(4 * cfg.hidden_size, 3 * cfg.intermediate_size)
        activations = config.max_num_batched_tokens * widest * itemsize + 2 * config.max_num_seqs * cfg.vocab_size * 4
        return weights + activations + CUDA_CONTEXT_BYTES

    @staticmethod
    def _check_blocks(budget: float, bytes_per_block: int) -> int:
        num_blocks = int(budget // bytes_per_block)
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget ({budget / GIB:.3f} GiB) holds fewer than 2 blocks of "
                f"{bytes_per_block} bytes; raise kv_cache_gib or gpu_memory_utilization"
            )
        return num_blocks

    def _prefaulter(self, config: EngineConfig, bytes_per_block: int) -> CachePrefaulter:
        """Keeps PREFAULT_AHEAD_BYTES of blocks past the highest used faulted in, and at least four steps of full
        prefill chunks (the demo model: 8,192 blocks, the KV of ~30 prompts of 4,000 tokens). `bytes_per_block`: of
        every cache a block id has (the draft's too), as the memory plan counted them."""
        caches = [self.kv_cache] + ([self.draft.cache] if self.draft is not None else [])
        four_steps = 4 * -(-config.max_num_batched_tokens // config.block_size)
        return CachePrefaulter(caches, self.num_blocks, max(four_steps, PREFAULT_AHEAD_BYTES // bytes_per_block))

    def keep_cache_ahead_of(self, used_blocks: int) -> None:
        """`used_blocks`: block ids below it have been handed out at least once (on CPU, fault in what follows)."""
        if self.prefaulter is not None:
            self.prefaulter.keep_ahead_of(used_blocks)

    def _device_cache(self) -> torch.Tensor:
        return device_cache(self.block_shape, self.num_blocks, self.kv_dtype, self.device)

    @property
    def host_cache(self) -> torch.Tensor:
        """The swap space: host memory for swapped-out blocks, allocated when first needed."""
        if self._host_cache is None:
            self._host_cache = host_cache(self.block_shape, self.num_host_blocks, self.kv_dtype, self.device)
            log.info("swap space: allocated for %d blocks", self.num_host_blocks)
        return self._host_cache

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """The KV of these blocks as bytes in the cache's layout (engine/kv_transfer.py: KVChunk)."""
        index = torch.tensor(block_ids, device=self.device)
        return self._raw_cache()[:, :, :, index].contiguous().cpu().numpy().tobytes()

    def write_blocks(self, data: bytes, num_blocks: int, pairs: list[tuple[int, int]]) -> None:
        """Copies blocks of `data` (num_blocks blocks in the cache's layout) into this cache: (position in data,
        block id) pairs."""
        raw = self._raw_cache()
        layers, kv, heads, _, block_bytes = raw.shape
        if len(data) != layers * kv * heads * num_blocks * block_bytes:
            raise ValueError(f"{len(data)} bytes do not make {num_blocks} KV blocks of this cache")
        source = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(layers, kv, heads, num_blocks, block_bytes)
        positions = torch.tensor([p for p, _ in pairs])
        blocks = torch.tensor([b for _, b in pairs], device=self.device)
        raw[:, :, :, blocks] = source[:, :, :, positions].to(self.device)

    def _raw_cache(self) -> torch.Tensor:
        """The cache viewed as bytes: [layers, 2, KV heads, blocks, bytes per block row]."""
        return self.kv_cache.view(torch.uint8)

    def use_decode_kernel(self, op: DecodeKernel | None) -> None:
        """Decode attention through a fused paged op (the CPU kernel), or the PyTorch gather path when None. A
        choice made here stands: a kernel still being built is not switched to any more."""
        self._kernel_build = None
        self.decode_kernel = op
        self.inputs = InputBuilder(self.block_size, self.device, self.dtype, uses_kernel=op is not None)
        for attention in attention_layers(self.model):  # each layer's self_attn.attn
            attention.decode_kernel = op
        fused = torch.ops.tokenfleet.silu_and_mul if op is not None else None  # the same library holds all three
        for mlp in mlp_layers(self.model):
            mlp.silu_and_mul = fused
        norm = torch.ops.tokenfleet.rms_norm if op is not None else None
        for layer in norm_layers(self.model):
            layer.fused = norm

    def _take_kernel_when_built(self, build: Future[DecodeKernel | None]) -> None:
        """The kernel now if it is loaded; else the PyTorch path until its background build is done, then the
        kernel from the next step on (execute switches between steps, never within one)."""
        if build.done():
            self.use_decode_kernel(build.result())
        else:
            self._kernel_build, self._kernel_wait_started = build, time.monotonic()

    def _switch_to_built_kernel(self) -> None:
        build = self._kernel_build
        if build is None or not build.done():
            return
        op = build.result()
        self.use_decode_kernel(op)
        if op is not None:  # else the build failed, which cpu_kernels logged: decoding stays on the PyTorch path
            log.info(
                "CPU attention kernel loaded: decode attention uses it from this step on (after %.0f s on the "
                "PyTorch path)",
                time.monotonic() - self._kernel_wait_started,
            )

    def _calibrate_kv_scales(self, config: EngineConfig) -> list[KVScales]:
        """Each layer's 8-bit cache scales, from the largest keys and values of one seeded prefill: fixed for the
        engine's life, since every cached block (prefix cache, swap space) must be read back with the scales it was
        written with, and the same weights always get the same scales."""
        ranges = measure_kv_ranges(
            self.model,
            self.device,
            config.block_size,
            min(CALIBRATION_TOKENS, config.max_model_len or self.model.config.max_model_len),
        )
        scales = [KVScales(scale_for(k, self.kv_dtype), scale_for(v, self.kv_dtype)) for k, v in ranges]
        for attention, layer_scales in zip(attention_layers(self.model), scales):
            attention.kv_scales = layer_scales
        log.info("KV cache scales (key, value) per layer: %s", ", ".join(f"({s.k:g}, {s.v:g})" for s in scales))
        return scales

    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor | None, list[ScheduledChunk]]:
        """Runs one step; returns logits and the chunks they belong to, in order: one row per chunk, or 1 + k rows
        for a chunk that verifies k proposals."""
        started = time.perf_counter()
        self._switch_to_built_kernel()
        self._swap(out)
        if not out.chunks:
            self.last_prepare_s = time.perf_counter() - started
            return None, []
        inputs = self.prepare(out.chunks)
        self.last_prepare_s = time.perf_counter() - started
        logits = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, inputs.logits_indices)
        if self.draft is not None:
            self.draft.mirror_prefills(out.chunks)
        return logits, inputs.sampled

    def _swap(self, out: SchedulerOutput) -> None:
        if out.swap_out:
            copy_blocks(self.kv_cache, self.host_cache, out.swap_out)
        if out.swap_in:
            copy_blocks(self.host_cache, self.kv_cache, out.swap_in)
        if self.draft is not None:
            self.draft.swap(out)

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """The step's flat inputs: decode rows first (sorted by context length), then each prefill chunk."""
        return self.inputs.for_chunks(chunks)


def device_cache(
    block_shape: tuple[int, ...], num_blocks: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[layers, 2, KV heads, blocks, block elements], zeroed. On CPU its pages are committed as blocks are first
    written (huge pages where Linux gives them), or a little ahead of that while the engine is idle (prefault.py)."""
    layers, kv, heads, block_elems = block_shape
    shape = (layers, kv, heads, num_blocks, block_elems)
    if device.type != "cpu":
        cache = torch.empty(shape, dtype=dtype, device=device)
        as_bytes(cache).zero_()
        return cache
    cache = lazily_zeroed(shape, dtype)
    advise_huge_pages(cache)
    return cache


def host_cache(block_shape: tuple[int, ...], num_blocks: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Swap space in host memory for a cache of this block shape (pinned for a GPU's copies)."""
    layers, kv, heads, block_elems = block_shape
    shape = (layers, kv, heads, num_blocks, block_elems)
    if device.type == "cuda":
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    return lazily_zeroed(shape, dtype)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copies (source block, destination block) pairs between two caches of one block shape."""
    src_blocks = torch.tensor([s for s, _ in pairs], device=src.device)
    dst_blocks = torch.tensor([d for _, d in pairs], device=dst.device)
    src, dst = as_bytes(src), as_bytes(dst)  # an 8-bit cache moves its bytes as they are
    dst[:, :, :, dst_blocks] = src[:, :, :, src_blocks].to(dst.device, non_blocking=True)


def measure_kv_ranges(
    model: LlamaForCausalLM, device: torch.device, block_size: int, num_tokens: int
) -> list[tuple[float, float]]:
    """The largest |key| and |value| of each layer over one prefill of seeded pseudo-random tokens, run on a
    scratch cache in the model's dtype (so nothing is quantized yet)."""
    cfg = model.config
    tokens = torch.randint(cfg.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(num_tokens)
    num_blocks = -(-num_tokens // block_size)
    scratch = torch.zeros(
        (cfg.num_layers, 2, cfg.num_kv_heads, num_blocks, block_size * cfg.head_dim),
        dtype=next(model.parameters()).dtype,
        device=device,
    )
    meta = AttentionMetadata(
        (positions // block_size).to(device),
        (positions % block_size).to(device),
        block_size,
        [],
        [PrefillChunk(0, num_tokens, None, None)],
    )
    ranges: list[tuple[float, float]] = []

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:  # args: q, k, v, kv_cache, meta
        ranges.append((args[1].abs().max().item(), args[2].abs().max().item()))

    hooks = [attention.register_forward_pre_hook(record) for attention in attention_layers(model)]
    try:
        model(tokens.to(device), positions.to(device), scratch, meta, torch.tensor([num_tokens - 1], device=device))
    finally:
        for hook in hooks:
            hook.remove()
    return ranges


def mlp_layers(model: LlamaForCausalLM) -> list[MLP]:
    return [m for m in model.modules() if isinstance(m, MLP)]


def norm_layers(model: LlamaForCausalLM) -> list[RMSNorm]:
    return [m for m in model.modules() if isinstance(m, RMSNorm)]


def attention_layers(model: LlamaForCausalLM) -> list[PagedAttention]:
    """Each layer's paged attention, in layer order."""
    return [m for m in model.modules() if isinstance(m, PagedAttention)]
