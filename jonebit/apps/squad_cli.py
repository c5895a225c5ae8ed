"""``jonebit squad-eval DATA.json PREDICTIONS.json`` and ``jonebit squad-download DIR``.

``squad-eval`` is the official SQuAD v1.1 evaluation: it prints ``{"exact_match": ..., "f1": ...}`` (percent) as
``evaluate-v1.1.py`` does. ``squad-download`` fetches the official v1.1 files and checks their size and sha256.
"""

from __future__ import annotations

import json
import logging
import sys


def add_parser(subparsers) -> None:
    """Registers ``jonebit squad-eval`` and ``jonebit squad-download`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "squad-eval",
        help="official SQuAD v1.1 exact match and F1 of a predictions.json",
        description="Official SQuAD v1.1 evaluation: prints {\"exact_match\": ..., \"f1\": ...} in percent.",
        epilog="example: jonebit squad-eval dev-v1.1.json out/predictions.json",
    )
    p.add_argument("dataset_file", metavar="DATA.json", help="the SQuAD v1.1 data set (e.g. dev-v1.1.json)")
    p.add_argument("prediction_file", metavar="PREDICTIONS.json", help="question id -> predicted answer text")
    p.set_defaults(func=_run_eval)

    d = subparsers.add_parser(
        "squad-download",
        help="download the official SQuAD v1.1 files and verify size and sha256",
        description="Downloads train-v1.1.json and/or dev-v1.1.json into DIR and verifies them.",
        epilog="example: jonebit squad-download data/squad --split dev",
    )
    d.add_argument("directory", metavar="DIR", help="destination directory (created if needed)")
    d.add_argument("--split", choices=("train", "dev", "all"), default="all", help="which file (default: all)")
    d.set_defaults(func=_run_download)


def _run_eval(args) -> int:
    from jonebit.data.squad_metric import evaluate_files

    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    try:
        result = evaluate_files(args.dataset_file, args.prediction_file)
    except (OSError, ValueError) as e:
        print(f"jonebit squad-eval: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def _run_download(args) -> int:
    from jonebit.data.squad_download import DownloadError, download_squad

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    splits = ("train", "dev") if args.split == "all" else (args.split,)
    try:
        paths = download_squad(args.directory, splits)
    except (OSError, DownloadError) as e:
        print(f"jonebit squad-download: {e}", file=sys.stderr)
        return 1
    for split, path in paths.items():
        print(f"{split}: {path} (verified)")
    return 0
