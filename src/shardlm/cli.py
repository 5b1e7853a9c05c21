"""The `shardlm` command line.

    shardlm train [--config FILE] [--run-dir DIR] [--cpu-devices N] [--overwrite] [--explain] [--no-progress]
                  [key=value ...]
    shardlm explain [--config FILE] [--cpu-devices N] [key=value ...]

JAX is imported only after the arguments are parsed, so `--cpu-devices` can still set the simulated device count.
Bad input (a `ShardlmError`) prints one line and exits with 2; set SHARDLM_DEBUG=1 to see its traceback.
"""

import argparse
import os
import sys

from shardlm.errors import ShardlmError

EXIT_USAGE = 2


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML config file (overrides apply on top)")
    p.add_argument("--cpu-devices", type=int, metavar="N",
                   help="simulate N devices on the CPU host (sets XLA_FLAGS before JAX starts)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. model=tiny train.steps=20 mesh.fsdp=-1")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="shardlm", description="Pretrain GPT-style models with JAX on any mesh.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (default: tiny GPT on the built-in Shakespeare corpus)")
    _common(train)
    train.add_argument("--run-dir", metavar="DIR", help="where the run's files go (default: runs/<name>)")
    train.add_argument("--overwrite", action="store_true", help="replace an existing run in --run-dir")
    train.add_argument("--explain", action="store_true", help="print every parameter's placement before training")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    explain = sub.add_parser("explain", help="print every parameter's shape, partition spec and bytes per device")
    _common(explain)
    return parser, {"train": train, "explain": explain}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Options may stand anywhere among the key=value overrides (`train a=1 --run-dir x b=2`)."""
    parser, commands = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in commands:
        return parser.parse_args(argv)  # help, or argparse's own error for an unknown command
    args = commands[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def _run(args: argparse.Namespace) -> None:
    if args.cpu_devices is not None:
        from shardlm.mesh import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices)
    from shardlm.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.command == "train":
        from shardlm.train.loop import train

        train(cfg, args.run_dir, overwrite=args.overwrite, progress=not args.no_progress, explain=args.explain)
    elif args.command == "explain":
        from shardlm.explain import explain
        from shardlm.mesh import mesh_from_config
        from shardlm.train.loop import load_data
        from shardlm.train.state import create_train_state

        mesh = mesh_from_config(cfg.mesh)
        vocab = cfg.model.vocab_size or load_data(cfg)[0].vocab_size
        print(explain(create_train_state(cfg, mesh, vocab).state, mesh))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        _run(args)
    except ShardlmError as e:
        if os.environ.get("SHARDLM_DEBUG"):
            raise
        print(f"shardlm: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("shardlm: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
