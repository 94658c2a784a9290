"""The `shardtrain` command: `coordinator`, `shard`, `demo` and `health`, each handed to its component."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

COMMANDS = {
    "coordinator": ("coordinator.server", "run the coordinator service"),
    "shard": ("shard_service.server", "run one shard service"),
    "demo": ("client_sdk.demo", "train the seed's residual model on a local 3-shard cluster, or a running one"),
    "health": ("shardtrain.probe", "ask a coordinator or shard whether it serves (exit 0) or not (1)"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatches `shardtrain COMMAND [flags]`; components are imported only when their command runs."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:
        print(f"shardtrain {importlib.metadata.version('shardtrain')}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        print("usage: shardtrain {coordinator,shard,demo,health} [--help] | --version\n", file=sys.stderr)
        for name, (_, summary) in COMMANDS.items():
            print(f"  {name:<12} {summary}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] in SERVICES:
        return serve(argv[0], argv[1:])
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


# A service's flags are parsed before its module (and torch) is imported: --help and a bad flag answer at once.
SERVICES = {"coordinator": "coordinator_settings", "shard": "shard_settings"}


def serve(command: str, argv: list[str]) -> int:
    """Runs a service: its flags first, then its module's run(settings)."""
    from shardtrain import logs, settings
    logs.configure()  # until the flags say otherwise: parsing them may warn
    parsed = getattr(settings, SERVICES[command])(argv)
    logs.configure(parsed.log_level, parsed.log_format)
    return importlib.import_module(COMMANDS[command][0]).run(parsed)


if __name__ == "__main__":
    sys.exit(main())
