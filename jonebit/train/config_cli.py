"""``jonebit config [check] FILE [--dp-size N]``: validate a DeepSpeed config and print what jonebit makes of it.

Prints the resolved batch arithmetic, precision and loss scaling, ZeRO stage, optimizer (with the ``freeze_step``
mapping of 1-bit Adam) and the learning rate at a few updates, then exits 0; on a bad config it prints the error
(naming the key) and exits 2.
"""

from __future__ import annotations

import logging
import sys


def add_parser(subparsers) -> None:
    """Registers ``jonebit config`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "config",
        help="validate a DeepSpeed config and print the resolved settings",
        description=__doc__.split("\n\n")[0],
        epilog="example: jonebit config check ds_config.json --dp-size 8",
    )
    p.add_argument("args", nargs="+", metavar="[check] FILE", help="the DeepSpeed JSON config")
    p.add_argument(
        "--dp-size", "--world-size", dest="dp_size", type=int, default=None,
        help="data-parallel ranks (default: inferred when all three batch sizes are given, else 1)",
    )
    p.add_argument("--steps", type=int, nargs="+", default=None, help="updates at which to print the learning rate")
    p.set_defaults(func=_run)


def _infer_dp(config) -> int:
    train, micro, gas = (config.train_batch_size, config.train_micro_batch_size_per_gpu,
                         config.gradient_accumulation_steps)
    if train is not None and micro is not None and gas is not None:
        return train // (micro * gas)  # load_config checked divisibility
    return 1


def _run(args) -> int:
    from jonebit.train.config import ConfigError, describe, load_config

    rest = args.args[1:] if args.args[0] == "check" and len(args.args) > 1 else args.args
    if len(rest) != 1:
        print(f"jonebit config: expected one FILE, got {' '.join(args.args)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    try:
        config = load_config(rest[0])
        dp = args.dp_size if args.dp_size is not None else _infer_dp(config)
        if args.dp_size is not None:
            note = ""
        elif config.gradient_accumulation_steps is not None and None not in (
            config.train_batch_size, config.train_micro_batch_size_per_gpu
        ):
            note = f" (data-parallel size {dp} from the three batch sizes)"
        else:
            note = f" (data-parallel size {dp} assumed; set it with --dp-size)"
        # Resolve everything before saying "valid": the batch arithmetic for this dp size can still fail.
        text = describe(config, dp, steps=args.steps)
    except ConfigError as e:
        print(f"{rest[0]}: invalid DeepSpeed config\n  {e}", file=sys.stderr)
        return 2
    print(f"{rest[0]}: valid DeepSpeed config{note}")
    print(text)
    return 0
