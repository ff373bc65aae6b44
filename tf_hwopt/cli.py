"""The `tf-hwopt` command line.

    tf-hwopt demo [--epochs N] [--samples N] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import sys


def _positive(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return number


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tf-hwopt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a 1D ResNet on MNIST-1D without and with EgeriaCallback; print the comparison",
    )
    demo.add_argument("--samples", type=_positive, default=50_000, help="MNIST-1D examples (80%% train)")
    demo.add_argument("--epochs", type=_positive, default=10)
    demo.add_argument("--batch-size", type=_positive, default=256)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--plot", default="egeria_demo.png", help="PNG path ('' for none)")
    demo.add_argument("--json", default=None, help="also write the numbers as JSON here")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from tf_hwopt.demo import run_demo

        run_demo(
            num_samples=args.samples,
            epochs=args.epochs,
            batch_size=args.batch_size,
            seed=args.seed,
            plot_path=args.plot or None,
            json_path=args.json,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
