"""The `tokenfleet` command line. Each subcommand is one `add_*` function (arguments) plus one `run_*` function,
registered in COMMANDS; add new subcommands by appending to that table."""
from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def add_demo_model(parser: argparse.ArgumentParser) -> None:
    from tokenfleet.model.demo import SIZES

    parser.add_argument("dir", help="folder to write the checkpoint into (created if missing)")
    parser.add_argument("--size", choices=list(SIZES), default="small", help="model size (default: small)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights (default: 0)")


def run_demo_model(args: argparse.Namespace) -> int:
    from tokenfleet.model.demo import write_demo_checkpoint

    path = write_demo_checkpoint(args.dir, size=args.size, seed=args.seed)
    print(f"wrote {args.size} demo checkpoint to {path}")
    return 0


def add_generate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", help="prompts, generated together in one continuous batch")
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)


def run_generate(args: argparse.Namespace) -> int:
    from tokenfleet import LLM, SamplingParams

    llm = LLM(args.model)
    prompts = args.prompts
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for prompt, out in zip(args.prompts, llm.generate(prompts, params)):
        print(f"--- {prompt!r} ({len(out.token_ids)} tokens, {out.finish_reason})\n{out.text}")
    return 0


def add_drain_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM: stop accepting, let in-flight streams finish for at most this many seconds")


def add_replica(parser: argparse.ArgumentParser) -> None:
    from tokenfleet.config import add_engine_arguments

    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients use (default: the checkpoint folder's name)")
    add_drain_argument(parser)


def run_replica(args: argparse.Namespace) -> int:
    from tokenfleet.replica.main import serve_replica

    serve_replica(args)
    return 0


def add_serve(parser: argparse.ArgumentParser) -> None:
    from tokenfleet.config import add_engine_arguments

    add_engine_arguments(parser, model_required=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--ping-interval", type=float, default=15.0, help="seconds between SSE heartbeats")
    parser.add_argument("--disconnect-grace", type=float, default=5.0,
                        help="seconds a dropped stream keeps generating, waiting for a resume, before it is cancelled")
    parser.add_argument("--safety-hook", default=None,
                        help="package.module:function, an async check called on every request (default: allow all)")
    add_drain_argument(parser)


def run_serve(args: argparse.Namespace) -> int:
    from tokenfleet.gateway.main import serve_embedded

    serve_embedded(args)
    return 0


def add_gateway(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="fleet.yaml (see docs/architecture.md)")


def run_gateway(args: argparse.Namespace) -> int:
    from tokenfleet.gateway.main import serve_gateway

    serve_gateway(args)
    return 0


COMMANDS: list[Command] = [
    Command("serve", "gateway and one replica in one process (demo checkpoint without --model)", add_serve,
            run_serve),
    Command("gateway", "the public API in front of replicas listed in a fleet.yaml", add_gateway, run_gateway),
    Command("replica", "serve one model with the OpenAI-compatible replica server", add_replica, run_replica),
    Command("generate", "generate completions offline for a few prompts", add_generate, run_generate),
    Command("demo-model", "write a small random-weight Llama checkpoint (no download needed)",
            add_demo_model, run_demo_model),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenfleet", description="tokenfleet LLM serving platform")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)
