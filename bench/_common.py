"""What the bench scripts share: the prompt vocabulary, reading a streamed chat completion, percentiles, waiting for
the machine to go idle, child environments, the report's machine and version lines, and the command-line pieces.

Stdlib only at import time, like the scripts' own top-level imports: their --help and their worker subprocesses
must start without httpx, tokenizers or torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _pkg_version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONTENDED = 0.10  # others_cpu above this (fraction of all cores) marks a timing as unreliable

# Prompt vocabulary: common English words (fixed, so prompts are reproducible for a given seed).
WORDS = """the of and to in is was that for it with as his on be at by had are but from or have an they which one
you were her all she there would their we him been has when who will more no if out so said what up its about into
than them can only other new some could time these two may then do first any my now such like our over man me even
most made after also did many before must through back years where much your way well down should because each just
those people how too little state good very make world still own see men work long get here between both life being
under never day same another know while last might us great old year off come since against go came right used take
three states himself few house use during without again place around however home small found thought went say part
once general high upon school every does got united left number course war until always away something fact though
water less public put think almost hand enough far took head yet government system better set told nothing night end
why called didn find going look asked later knew point next program city business give group toward young days let
room president side social given present several order national possible rather second face per among form important
often things looking early white case john become large big need four within felt along children saw best church ever
least power development light thing seemed family interest want members mind country area others done turned although
open god service certain kind problem began different door thus help sense means whole matter perhaps itself york
times law human line above name example action company hands local show whether five history gave today either act
feet across taken past quite anything seen having death experience body word half really week field car words already
themselves information tell college shall money period held keep sure free real probably seems political cannot
behind miss question air office making brought whose special heard major problems ago became federal moment study
available known result street economic boy position reason change south board individual job society areas west close
turn love community true court force full""".split()


# ----------------------------------------------------------------------------------------------------------------- #
# workload and client
# ----------------------------------------------------------------------------------------------------------------- #


def prompt_text(rng: random.Random, tok, n_tokens: int) -> str:
    """Random words cut to exactly n_tokens tokens of the checkpoint's tokenizer (every word is >= 1 token)."""
    text = " ".join(rng.choice(WORDS) for _ in range(n_tokens))
    enc = tok.encode(text, add_special_tokens=False)
    if len(enc.ids) > n_tokens:
        text = text[: enc.offsets[n_tokens - 1][1]]
    return text


async def _sse_chunks(response):
    """The JSON chunks of an OpenAI-style event stream up to [DONE], each with the time.perf_counter() its line
    arrived at."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # id:, event:, ": ping" comments, blank lines
        arrived = time.perf_counter()
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield arrived, json.loads(data)


def _error_event(chunk: dict, limit: int) -> str | None:
    if chunk.get("error") is None and chunk.get("object") != "error":
        return None
    return f"error event: {str(chunk.get('error', chunk))[:limit]}"


class ChatStream:
    """What a streamed chat completion delivered: each content delta with the time its line arrived, the usage and
    the finish reason.  Filled as the stream goes, so a timeout or a dropped connection keeps what came before."""

    def __init__(self) -> None:
        self.content: list[tuple[float, str]] = []
        self.usage: dict | None = None
        self.finish: str | None = None

    @property
    def first_content_at(self) -> float | None:
        return self.content[0][0] if self.content else None

    async def read(self, response, limit: int = 300) -> str | None:
        """Reads the response to its end; returns its error (a non-200 status or an error event, cut to `limit`
        characters), None when there was none."""
        if response.status_code != 200:
            return f"HTTP {response.status_code}: {(await response.aread())[:limit].decode(errors='replace')}"
        async for arrived, chunk in _sse_chunks(response):
            err = _error_event(chunk, limit)
            if err:
                return err
            if chunk.get("usage"):
                self.usage = chunk["usage"]
            for ch in chunk.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    self.content.append((arrived, piece))
                if ch.get("finish_reason"):
                    self.finish = ch["finish_reason"]
        return None


def pct(xs: list[float], p: float) -> float | None:
    """Percentile with linear interpolation (numpy's default); p from 0 to 100."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# ----------------------------------------------------------------------------------------------------------------- #
# the machine and the child processes
# ----------------------------------------------------------------------------------------------------------------- #


def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of all CPUs busy during `seconds` (from /proc/stat), measured while this harness is idle."""

    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v) - idle, sum(v)

    try:
        b0, t0 = snap()
        time.sleep(seconds)
        b1, t1 = snap()
        return (b1 - b0) / max(1, t1 - t0)
    except OSError:
        return 0.0


def wait_idle(limit: float, name: str = "") -> float:
    """Waits up to `limit` seconds for other work on the machine to stop; returns the busy fraction it ended on.
    `name` tags the message ([name])."""
    tag = f"[{name}] " if name else ""
    busy, waited = cpu_busy(), 0.0
    while busy > 0.25 and waited < limit:
        if waited == 0:
            print(
                f"{tag}CPU {100 * busy:.0f}% busy with other work; waiting up to {limit:.0f}s for it to go idle",
                flush=True,
            )
        time.sleep(4)
        waited += 5
        busy = cpu_busy()
    return busy


def thread_env(threads: int) -> dict:
    """This process's environment with a child's thread pools sized to `threads`."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    return env


def repo_env(threads: int) -> dict:
    """thread_env with this checkout first on PYTHONPATH, so a child imports this tree's tokenfleet."""
    env = thread_env(threads)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def given_checkpoint(model: str) -> tuple[Path, str]:
    """--model: an existing checkpoint folder and where it came from (exits when it has no config.json)."""
    d = Path(model).resolve()
    if not (d / "config.json").exists():
        sys.exit(f"--model {d}: no config.json")
    return d, "given (--model)"


# ----------------------------------------------------------------------------------------------------------------- #
# report
# ----------------------------------------------------------------------------------------------------------------- #


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what platform knows of it."""
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def memory_total() -> str:
    try:
        kb = int(
            next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")).split()[1]
        )
    except (OSError, StopIteration, ValueError):
        return "?"
    return f"{kb / 2**20:.1f} GiB"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO, timeout=10).stdout.strip()


def git_head() -> str:
    """The checkout's short commit id; '' where git does not answer."""
    try:
        return _git("rev-parse", "--short", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return ""


def package_versions(packages: tuple[str, ...]) -> dict:
    """The installed version of each package (None: not installed); tokenfleet's also names the commit and whether
    tokenfleet/ has uncommitted changes."""
    v = {}
    for pkg in packages:
        try:
            v[pkg] = _pkg_version(pkg)
        except PackageNotFoundError:
            v[pkg] = None
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--", "tokenfleet")
    except (OSError, subprocess.SubprocessError):
        return v
    if head and "tokenfleet" in v:
        v["tokenfleet"] = f"{v['tokenfleet']} (git {head}{', uncommitted changes in tokenfleet/' if dirty else ''})"
    return v


def report_to_rerender(args) -> tuple[dict, Path]:
    """--rerender: the earlier run's JSON report with the --note lines added to its notes, and the markdown file
    next to it to rewrite."""
    src = Path(args.rerender)
    rep = json.loads(src.read_text())
    rep["notes"] = rep.get("notes", []) + args.note
    return rep, src.with_suffix(".md")


# ----------------------------------------------------------------------------------------------------------------- #
# command line
# ----------------------------------------------------------------------------------------------------------------- #


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser, described by the first paragraph of its docstring."""
    return argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_checkpoint_args(
    p: argparse.ArgumentParser,
    ckpt_dir: str,
    sizes: tuple[str, ...] = ("small", "medium"),
    builtin_help: str = argparse.SUPPRESS,
) -> None:
    """--model, --size, --builtin-checkpoint and --ckpt-root (under the temp dir's tokenfleet-bench/ckpt_dir), as
    offline_throughput.ensure_checkpoint reads them."""
    p.add_argument("--model", help="existing HF checkpoint directory (overrides --size)")
    p.add_argument("--size", choices=list(sizes), default="small")
    p.add_argument("--builtin-checkpoint", action="store_true", help=builtin_help)
    p.add_argument("--ckpt-root", default=os.path.join(tempfile.gettempdir(), "tokenfleet-bench", ckpt_dir))


def add_length_args(p: argparse.ArgumentParser) -> None:
    """--seed and the ranges the prompt and output lengths are drawn from."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=512)
    p.add_argument("--output-min", type=int, default=8)
    p.add_argument("--output-max", type=int, default=256)


def known_names(parser: argparse.ArgumentParser, given: str, known: list[str], what: str) -> list[str]:
    """The comma-separated names of `given`, in the order of `known`; a parser error names any unknown one."""
    names = [n.strip() for n in given.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        parser.error(f"unknown {what} {bad}; choose from {known}")
    return [n for n in known if n in names]


def command_line(script: str) -> str:
    """How this run was started, for the report: the script relative to the checkout, then its arguments."""
    return "python " + " ".join(shlex.quote(a) for a in ([os.path.relpath(script, REPO)] + sys.argv[1:]))


def report_header(script: str, machine: str, load: dict[str, str]) -> list[str]:
    """The opening lines of a lever benchmark's report: the command, the machine, the load before and after."""
    return [
        "Command: `" + command_line(script) + "`",
        "",
        f"Machine: {machine}",
        f"Load before: `{load['before']}`",
        f"Load after: `{load['after']}`",
        "",
    ]


def make_run_dir(given: str | None, prefix: str) -> Path:
    """--run-dir, or a new temp dir named with `prefix`."""
    run_dir = Path(given) if given else Path(tempfile.mkdtemp(prefix=prefix))
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir
