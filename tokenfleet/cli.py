"""The `tokenfleet` command line. Each subcommand is one function that adds its arguments plus one that runs it,
registered in COMMANDS (most of them `Deferred`: imported from the command's own module only when used); add new
subcommands by appending to that table."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Deferred:
    """`module.function`, imported when first called: each command imports what it needs (the engine's, PyTorch)
    only when it parses its arguments or runs. An object rather than a closure: `gateway --workers` hands the
    parsed arguments, this included, to its worker processes."""

    module: str
    function: str

    def __call__(self, arg: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.function)(arg)


@dataclass(frozen=True)
class UntilDone:
    """A command that serves until it is stopped: its exit status is 0 once it returns."""

    serve: Callable[[argparse.Namespace], None]

    def __call__(self, args: argparse.Namespace) -> int:
        self.serve(args)
        return 0


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
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: stop accepting, let in-flight streams finish for at most this many seconds",
    )


def add_model_server_arguments(
    parser: argparse.ArgumentParser, port: int, model_required: bool, name_help: str | None = None
) -> None:
    """What a process serving a model takes first: the engine's options, where to listen, the model's name."""
    from tokenfleet.engine.config import SERVER_DEFAULTS, add_engine_arguments

    add_engine_arguments(parser, model_required=model_required, defaults=SERVER_DEFAULTS)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--served-model-name", default=None, help=name_help)


def add_replica(parser: argparse.ArgumentParser) -> None:
    name_help = "model name clients use (default: the checkpoint folder's name)"
    add_model_server_arguments(parser, 8100, model_required=True, name_help=name_help)
    add_drain_argument(parser)
    disagg = parser.add_argument_group("disaggregated prefill/decode")
    disagg.add_argument(
        "--role",
        choices=("both", "prefill", "decode"),
        default="both",
        help="both (default): prefill and decode its own requests; prefill: compute prompts' KV for decode "
        "replicas; decode: take prompts' KV from prefill replicas and generate",
    )
    disagg.add_argument(
        "--kv-port",
        type=int,
        default=0,
        help="decode role: TCP port for KV transfers (default: 0, any free port; /internal/kv/info tells it)",
    )
    fleet = parser.add_argument_group("fleet registry")
    fleet.add_argument(
        "--register",
        metavar="REDIS_URL",
        default=None,
        help="join the fleet: announce this replica in Redis once it serves, heartbeat, mark it "
        "draining at SIGTERM and withdraw it on exit (default: not registered)",
    )
    fleet.add_argument(
        "--advertise-url",
        metavar="URL",
        default=None,
        help="base URL gateways call (default: http://HOST:PORT; a wildcard HOST becomes this "
        "machine's hostname, or 127.0.0.1)",
    )
    fleet.add_argument("--pool", default="default", help="region / pool this replica belongs to (default: default)")
    fleet.add_argument(
        "--registry-prefix",
        default="tokenfleet:replicas:",
        help="Redis key prefix of the fleet's registry (default: tokenfleet:replicas:)",
    )
    fleet.add_argument(
        "--registry-ttl",
        type=float,
        default=6.0,
        help="seconds the record outlives the last heartbeat (heartbeats every ttl/3; default: 6)",
    )


def add_serve(parser: argparse.ArgumentParser) -> None:
    add_model_server_arguments(parser, 8000, model_required=False)
    parser.add_argument("--ping-interval", type=float, default=None, help="seconds between SSE heartbeats (15)")
    parser.add_argument(
        "--disconnect-grace",
        type=float,
        default=None,
        help="seconds a dropped stream keeps generating, waiting for a resume, before it is cancelled (5)",
    )
    parser.add_argument(
        "--config", default=None, help="fleet.yaml whose streams, tiers, quota, dispatch and overload sections apply"
    )
    parser.add_argument(
        "--safety-hook",
        default=None,
        help="package.module:function, an async check called on every request (default: allow all)",
    )
    parser.add_argument(
        "--auth",
        action="store_true",
        help="require API keys (`tokenfleet keys create`), with their tiers and quotas; without it "
        "the server is open to one user with no limits",
    )
    parser.add_argument(
        "--database-url",
        default=None,
        help="usage, and tenants and keys with --auth (default: the SQLite file in --data-dir, else "
        "$TOKENFLEET_DATABASE_URL, else --config's database_url, else the SQLite file in the default data dir)",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="this instance's folder, holding its SQLite database (default: ~/.local/share/tokenfleet/serve-PORT, "
        "one per port, printed at start)",
    )
    add_drain_argument(parser)


def add_gateway(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="fleet.yaml (see docs/architecture.md)")
    parser.add_argument("--host", default=None, help="address to listen on (default: the file's host)")
    parser.add_argument("--port", type=int, default=None, help="port to listen on (default: the file's port)")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="gateway processes on this port, sharing Redis and PostgreSQL (needs redis_url); default 1",
    )


def add_keys(parser: argparse.ArgumentParser) -> None:
    from tokenfleet.commands.database import add_database_arguments

    actions = parser.add_subparsers(dest="keys_action", required=True, metavar="ACTION")
    create = actions.add_parser(
        "create", help="create an API key (and its organisation and user when new); the key is printed once"
    )
    create.add_argument("--org", required=True, help="organisation name or id (created when missing)")
    create.add_argument("--user", required=True, help="user name in the organisation (created when missing)")
    create.add_argument("--tier", default=None, help="tier of a new organisation (default: free)")
    create.add_argument("--name", default="default", help="a label for the key (default: default)")
    listing = actions.add_parser("list", help="list API keys (prefixes only, never the keys)")
    listing.add_argument("--org", default=None, help="only this organisation's keys (name or id)")
    revoke = actions.add_parser("revoke", help="revoke an API key; it stops working at once")
    revoke.add_argument("key_id", help="the key's id (key_...), as shown by `tokenfleet keys list`")
    for action in (create, listing, revoke):
        add_database_arguments(action, "its database_url and tiers")


COMMANDS: list[Command] = [
    Command(
        "serve",
        "gateway and one replica in one process (demo checkpoint without --model)",
        add_serve,
        UntilDone(Deferred("tokenfleet.commands.serve", "serve_embedded")),
    ),
    Command(
        "gateway",
        "the public API in front of replicas listed in a fleet.yaml",
        add_gateway,
        UntilDone(Deferred("tokenfleet.commands.serve", "serve_gateway")),
    ),
    Command(
        "replica",
        "serve one model with the OpenAI-compatible replica server",
        add_replica,
        UntilDone(Deferred("tokenfleet.commands.replica", "serve_replica")),
    ),
    Command(
        "fleet",
        "a local fleet in one command: N replicas and a gateway on the local Redis and PostgreSQL",
        Deferred("tokenfleet.commands.fleet", "add_fleet_arguments"),
        Deferred("tokenfleet.commands.fleet", "run_fleet_command"),
    ),
    Command("generate", "generate completions offline for a few prompts", add_generate, run_generate),
    Command(
        "demo-model",
        "write a small random-weight Llama checkpoint (no download needed)",
        add_demo_model,
        run_demo_model,
    ),
    Command(
        "eval",
        "evaluation gate: perplexity, and KL divergence and top-1 agreement against a reference model",
        Deferred("tokenfleet.commands.eval", "add_eval"),
        Deferred("tokenfleet.commands.eval", "run_eval"),
    ),
    Command(
        "keys",
        "create, list and revoke API keys (runs database migrations first)",
        add_keys,
        Deferred("tokenfleet.commands.keys", "run_keys_command"),
    ),
    Command(
        "db",
        "create the database when missing and migrate it (db init)",
        Deferred("tokenfleet.commands.database", "add_db_arguments"),
        Deferred("tokenfleet.commands.database", "run_db_command"),
    ),
    Command(
        "usage",
        "tokens and cost by organisation, user, model and day; cost per million output tokens",
        Deferred("tokenfleet.commands.usage", "add_usage_arguments"),
        Deferred("tokenfleet.commands.usage", "run_usage_command"),
    ),
    Command(
        "simulate",
        "simulate a fleet (gateway, quotas, router, replicas) in simulated time: docs/simulator.md",
        Deferred("tokenfleet.sim.command", "add_simulate_arguments"),
        Deferred("tokenfleet.sim.command", "run_simulate_command"),
    ),
]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's arguments, or with `only` just that command's: each command imports what its arguments
    need (the engine's, PyTorch), so a command parses without importing the others'."""
    parser = argparse.ArgumentParser(prog="tokenfleet", description="tokenfleet LLM serving platform")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        if only is None or command.name == only:
            command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(only=argv[0] if argv else "").parse_args(argv)
    from tokenfleet.commands.errors import CommandError

    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:  # a mistake in flags or configuration: a message, not a traceback
        print(f"tokenfleet {args.command}: error: {e}", file=sys.stderr)
        return 2
    except CommandError as e:  # a service the command needs is missing or down
        print(f"tokenfleet {args.command}: error: {e}", file=sys.stderr)
        return 1
