"""Turns a scheduler decision into the step's tensors, moves swapped blocks, and runs the model."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenfleet.engine.config import EngineConfig
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
        self.num_blocks = self._device_blocks(config, bytes_per_block)
        self.num_host_blocks = int(config.swap_space_gib * GIB // bytes_per_block)
        self.kv_cache_tokens = self.num_blocks * config.block_size
        block_elems = config.block_size * cfg.head_dim  # layout inside a block: see model/attention.py
        self.kv_cache = torch.empty(
            (cfg.num_layers, 2, cfg.num_kv_heads, self.num_blocks, block_elems), dtype=self.kv_dtype, device=device
        )
        advise_huge_pages(self.kv_cache)
        as_bytes(self.kv_cache).zero_()
        self.host_cache = torch.zeros(
            (cfg.num_layers, 2, cfg.num_kv_heads, self.num_host_blocks, block_elems),
            dtype=self.kv_dtype,
            pin_memory=device.type == "cuda",
        )
        log.info(
            "KV cache: %d blocks of %d tokens = %d tokens, %s (%.2f GiB), swap space %d blocks",
            self.num_blocks,
            config.block_size,
            self.kv_cache_tokens,
            str(self.kv_dtype).removeprefix("torch."),
            self.num_blocks * bytes_per_block / GIB,
            self.num_host_blocks,
        )

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

    def _device_blocks(self, config: EngineConfig, bytes_per_block: int) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - config.gpu_memory_utilization) * total
        else:
            budget = config.kv_cache_gib * GIB
        num_blocks = int(budget // bytes_per_block)
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget ({budget / GIB:.3f} GiB) holds fewer than 2 blocks of "
                f"{bytes_per_block} bytes; raise kv_cache_gib or gpu_memory_utilization"
            )
        return num_blocks

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
