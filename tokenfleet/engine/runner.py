"""Turns a scheduler decision into the step's tensors, moves swapped blocks, and runs the model."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenfleet.engine.config import EngineConfig
from tokenfleet.engine.memory import Job, MemoryPlan, available_memory, lazily_zeroed, plan_cpu_memory
from tokenfleet.engine.request import Request
from tokenfleet.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenfleet.model.attention import AttentionMetadata, DecodeGroup, PagedAttention, PrefillChunk
from tokenfleet.model.cpu_kernels import advise_huge_pages, paged_decode_attention_op
from tokenfleet.model.kv_quant import KVScales, as_bytes, is_fp8, kv_cache_dtype, scale_for
from tokenfleet.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)
GIB = 1 << 30
CALIBRATION_TOKENS = 256  # one prefill of this many fixed pseudo-random tokens sets an 8-bit cache's scales
DecodeKernel = Callable[..., torch.Tensor]  # a fused paged decode attention op (see model/cpu_kernels.py)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[Request]  # one per logits row


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, device: torch.device) -> None:
        self.model, self.device, self.block_size = model, device, config.block_size
        self.last_prepare_s = 0.0  # time the last execute() spent on swaps and building inputs
        self.use_decode_kernel(paged_decode_attention_op() if device.type == "cpu" else None)
        cfg = model.config
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        # before the cache takes the GPU's free memory: calibration needs activations
        self.kv_scales = self._calibrate_kv_scales(config) if is_fp8(self.kv_dtype) else None
        bytes_per_block = config.block_size * cfg.kv_bytes_per_token(self.kv_dtype)
        plan = self._memory_plan(config, bytes_per_block)
        self.num_blocks, self.num_host_blocks = plan.num_blocks, plan.num_host_blocks
        self.kv_cache_tokens = self.num_blocks * config.block_size
        # layout inside a block: see model/attention.py
        self.block_shape = (cfg.num_layers, 2, cfg.num_kv_heads, config.block_size * cfg.head_dim)
        self.kv_cache = self._device_cache()
        self._host_cache: torch.Tensor | None = None  # the swap space, allocated at the first swap-out
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
            num_blocks = self._check_blocks(free - (1 - config.gpu_memory_utilization) * total, bytes_per_block)
            swap_gib = 1.0 if config.swap_space_gib is None else config.swap_space_gib
            return MemoryPlan(
                num_blocks,
                int(swap_gib * GIB // bytes_per_block),
                f"gpu_memory_utilization={config.gpu_memory_utilization:g}",
                f"swap_space_gib={swap_gib:g}",
            )
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

    @staticmethod
    def _check_blocks(budget: float, bytes_per_block: int) -> int:
        num_blocks = int(budget // bytes_per_block)
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget ({budget / GIB:.3f} GiB) holds fewer than 2 blocks of "
                f"{bytes_per_block} bytes; raise kv_cache_gib or gpu_memory_utilization"
            )
        return num_blocks

    def _device_cache(self) -> torch.Tensor:
        """[layers, 2, KV heads, blocks, block elements], zeroed. On CPU its pages are committed as blocks are first
        written (huge pages where Linux gives them)."""
        layers, kv, heads, block_elems = self.block_shape
        shape = (layers, kv, heads, self.num_blocks, block_elems)
        if self.device.type != "cpu":
            cache = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
            as_bytes(cache).zero_()
            return cache
        cache = lazily_zeroed(shape, self.kv_dtype)
        advise_huge_pages(cache)
        return cache

    @property
    def host_cache(self) -> torch.Tensor:
        """The swap space: host memory for swapped-out blocks, allocated when first needed."""
        if self._host_cache is None:
            layers, kv, heads, block_elems = self.block_shape
            shape = (layers, kv, heads, self.num_host_blocks, block_elems)
            if self.device.type == "cuda":
                self._host_cache = torch.zeros(shape, dtype=self.kv_dtype, pin_memory=True)
            else:
                self._host_cache = lazily_zeroed(shape, self.kv_dtype)
            log.info("swap space: allocated for %d blocks", self.num_host_blocks)
        return self._host_cache

    def use_decode_kernel(self, op: DecodeKernel | None) -> None:
        """Decode attention through a fused paged op (the CPU kernel), or the PyTorch gather path when None."""
        self.decode_kernel = op
        for attention in attention_layers(self.model):  # each layer's self_attn.attn
            attention.decode_kernel = op

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

    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor | None, list[Request]]:
        """Runs one step; returns logits [len(sampled), vocab] and the requests those rows belong to."""
        started = time.perf_counter()
        self._swap(out)
        if not out.chunks:
            self.last_prepare_s = time.perf_counter() - started
            return None, []
        inputs = self.prepare(out.chunks)
        self.last_prepare_s = time.perf_counter() - started
        logits = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, inputs.logits_indices)
        return logits, inputs.sampled

    def _swap(self, out: SchedulerOutput) -> None:
        if out.swap_out:
            self._copy_blocks(self.kv_cache, self.host_cache, out.swap_out)
        if out.swap_in:
            self._copy_blocks(self.host_cache, self.kv_cache, out.swap_in)

    def _copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        src_blocks = torch.tensor([s for s, _ in pairs], device=src.device)
        dst_blocks = torch.tensor([d for _, d in pairs], device=dst.device)
        src, dst = as_bytes(src), as_bytes(dst)  # an 8-bit cache moves its bytes as they are
        dst[:, :, :, dst_blocks] = src[:, :, :, src_blocks].to(dst.device, non_blocking=True)

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """The step's flat inputs: decodes first (sorted by context length), then each prefill chunk."""
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: c.req.num_computed_tokens)
        ids, positions, blocks, offsets, rows, sampled = self._decode_inputs(decodes)
        prefill_meta = []
        for chunk in (c for c in chunks if c.num_tokens > 1):
            req, start, n = chunk.req, chunk.req.num_computed_tokens, chunk.num_tokens
            table = torch.tensor(req.block_table)
            pos = torch.arange(start, start + n)
            prefill_meta.append(self._prefill_chunk(len(ids), start, n, table))
            ids.extend(req.token_ids[start : start + n])
            positions.append(pos)
            blocks.append(table[pos // self.block_size])
            offsets.append(pos % self.block_size)
            if chunk.samples:
                rows.append(len(ids) - 1)
                sampled.append(req)
        meta = AttentionMetadata(
            torch.cat(blocks).to(self.device),
            torch.cat(offsets).to(self.device),
            self.block_size,
            self._decode_groups(decodes),
            prefill_meta,
        )
        return StepInputs(
            torch.tensor(ids, device=self.device),
            torch.cat(positions).to(self.device),
            meta,
            torch.tensor(rows, dtype=torch.long, device=self.device),
            sampled,
        )

    def _decode_inputs(
        self, decodes: list[ScheduledChunk]
    ) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[int], list[Request]]:
        """Token ids (a list to extend) and position/block/offset tensors (lists to extend) of the decodes."""
        bs = self.block_size
        ids, pos, blocks = [], [], []
        for chunk in decodes:
            req = chunk.req
            p = req.num_computed_tokens
            ids.append(req.token_ids[p])
            pos.append(p)
            blocks.append(req.block_table[p // bs])
        rows = [i for i, c in enumerate(decodes) if c.samples]
        positions = torch.tensor(pos, dtype=torch.long)
        return (
            ids,
            [positions],
            [torch.tensor(blocks, dtype=torch.long)],
            [positions % bs],
            rows,
            [decodes[i].req for i in rows],
        )

    def _decode_groups(self, decodes: list[ScheduledChunk]) -> list[DecodeGroup]:
        """The kernel takes all decodes at once; the PyTorch path pads, so it splits the (context-sorted) decodes
        into up to 4 equal runs, each padded only to its own longest."""
        max_groups = 1 if self.decode_kernel else 4
        groups, size = [], -(-len(decodes) // max_groups) if decodes else 0
        for start in range(0, len(decodes), max(size, 1)):
            groups.append(self._decode_group(start, decodes[start : start + size]))
        return groups

    def _decode_group(self, start: int, decodes: list[ScheduledChunk]) -> DecodeGroup:
        context_lens = [c.req.num_computed_tokens + 1 for c in decodes]
        width = -(-max(context_lens) // self.block_size)
        tables = torch.zeros(len(decodes), width, dtype=torch.long)
        for i, chunk in enumerate(decodes):
            used = chunk.req.block_table[:width]
            tables[i, : len(used)] = torch.tensor(used)
        lens = torch.tensor(context_lens)
        mask = None
        if not self.decode_kernel:
            mask = self._additive(torch.arange(width * self.block_size) >= lens.unsqueeze(1))[None, :, None, :]
        return DecodeGroup(start, tables.to(self.device), lens.to(self.device), mask)

    def _additive(self, hidden: torch.Tensor) -> torch.Tensor:
        """A boolean 'masked out' tensor as an additive attention mask in the model's dtype."""
        mask = torch.zeros(hidden.shape, dtype=self.dtype)
        return mask.masked_fill_(hidden, float("-inf")).to(self.device)

    def _prefill_chunk(self, query_start: int, start: int, n: int, table: torch.Tensor) -> PrefillChunk:
        if start == 0:
            return PrefillChunk(query_start, n, None, None)
        context = torch.arange(start + n)
        where = (table[context // self.block_size].to(self.device), (context % self.block_size).to(self.device))
        future = context.unsqueeze(0) > torch.arange(start, start + n).unsqueeze(1)
        return PrefillChunk(query_start, n, where, self._additive(future))


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


def attention_layers(model: LlamaForCausalLM) -> list[PagedAttention]:
    """Each layer's paged attention, in layer order."""
    return [m for m in model.modules() if isinstance(m, PagedAttention)]
