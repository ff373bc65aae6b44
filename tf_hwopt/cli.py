"""The `tf-hwopt` command line.

    tf-hwopt demo [--epochs N] [--samples N] [--json PATH] [--plot PATH]
    tf-hwopt bench freezing [--profile quick|full] [--seeds N] [--json PATH] [--out-dir DIR] [--report-only]
    tf-hwopt bench search [--seeds 0,1,2] [--strategies random,bayesian,hyperband] [--max-trials N] [--json PATH]
    tf-hwopt bench timing [--repeats N] [--json PATH]
    tf-hwopt export MODEL.keras OUT_DIR [--int8-tflite] [--representative-data X.npy] [--overwrite]
"""

from __future__ import annotations

import argparse
import sys


def _positive(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return number


def _int_list(value: str) -> list[int]:
    try:
        numbers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        numbers = []
    if not numbers:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}")
    return numbers


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
    bench = sub.add_parser("bench", help="benchmarks that print measured ratios side by side")
    kinds = bench.add_subparsers(dest="bench", required=True)
    freezing = kinds.add_parser(
        "freezing",
        help="no freezing vs FreezeOut vs gradient-norm vs Egeria, from scratch (mnist1d, charlm) and "
        "fine-tuning (finetune-mnist1d, finetune-charlm), and ResNet-20 step time with k modules frozen",
    )
    freezing.add_argument("--profile", choices=("quick", "full"), default="quick")
    freezing.add_argument("--seeds", type=_positive, default=None, help="default: 1 (quick), 3 (full)")
    freezing.add_argument(
        "--workloads", default=None,
        help="comma-separated (default: all but charlm-long, the 12-epoch charlm, and digits-resnet50v2)",
    )
    freezing.add_argument(
        "--strategies", default="no_freeze,freezeout,gradnorm,egeria,egeria+cache",
        help="comma-separated (egeria+cache runs on mnist1d and the fine-tuning workloads; "
        "egeria-level, Egeria with plasticity_level=0.02, on request)",
    )
    freezing.add_argument("--no-throughput", action="store_true", help="skip the ResNet-20 step-time table")
    freezing.add_argument("--json", default="bench_results/freezing.json")
    freezing.add_argument("--out-dir", default=None, help="markdown and plots (default: the JSON's folder)")
    freezing.add_argument(
        "--report-only", action="store_true",
        help="train nothing: summarise the runs recorded in --json again and rewrite it, the table and the plots",
    )
    search = kinds.add_parser(
        "search",
        help="latency-aware RandomSearch/BayesianOptimization/Hyperband vs KerasTuner's + post-hoc latency filter",
    )
    search.add_argument("--seeds", type=_int_list, default=[0, 1, 2], help="comma-separated seeds")
    search.add_argument("--strategies", default="random,bayesian,hyperband", help="comma-separated")
    search.add_argument("--max-trials", type=_positive, default=8, help="random and Bayesian baselines' trials")
    search.add_argument("--max-epochs", type=_positive, default=4, help="Hyperband's max_epochs")
    search.add_argument("--epochs", type=_positive, default=2)
    search.add_argument("--samples", type=_positive, default=10_000, help="MNIST-1D examples (80%% train)")
    search.add_argument("--json", default="bench_results/search.json")
    timing = kinds.add_parser("timing", help="time_step repeatability on one model, and time_step vs a fit step")
    timing.add_argument("--repeats", type=_positive, default=8)
    timing.add_argument("--json", default="bench_results/timing.json")
    export = sub.add_parser("export", help="write a .keras model as a verified TensorFlow SavedModel")
    export.add_argument("model", help="a .keras file")
    export.add_argument("out_dir", help="the SavedModel folder to create")
    export.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    export.add_argument(
        "--int8-tflite", nargs="?", const="", default=None, metavar="PATH",
        help="also write an int8 TFLite model (default path: OUT_DIR.tflite)",
    )
    export.add_argument("--representative-data", default=None, help=".npy inputs that calibrate the int8 model")
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
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
    elif args.command == "bench" and args.bench == "freezing" and args.report_only:
        import os

        from tf_hwopt.bench.freezing import report_freezing_benchmark

        if not os.path.isfile(args.json):
            parser.error(f"--report-only needs an existing --json file; got {args.json!r}")
        report_freezing_benchmark(args.json, out_dir=args.out_dir)
    elif args.command == "bench" and args.bench == "freezing":
        from tf_hwopt.bench.freezing import run_freezing_benchmark
        from tf_hwopt.bench.workloads import DEFAULT_WORKLOADS

        run_freezing_benchmark(
            args.profile,
            seeds=args.seeds,
            workloads=[w for w in args.workloads.split(",") if w] if args.workloads else DEFAULT_WORKLOADS,
            strategies=[s for s in args.strategies.split(",") if s],
            throughput=not args.no_throughput,
            json_path=args.json,
            out_dir=args.out_dir,
        )
    elif args.command == "bench" and args.bench == "search":
        from tf_hwopt.bench.search import run_search_benchmark

        run_search_benchmark(seeds=args.seeds, strategies=args.strategies.split(","), max_trials=args.max_trials,
                             max_epochs=args.max_epochs, epochs=args.epochs, samples=args.samples, json_path=args.json)
    elif args.command == "bench" and args.bench == "timing":
        from tf_hwopt.bench.search import run_timing_benchmark

        run_timing_benchmark(repeats=args.repeats, json_path=args.json)
    elif args.command == "export":
        return _export(parser, args)
    return 0


def _export(parser, args) -> int:
    import json
    import os

    if not os.path.isfile(args.model) or not args.model.endswith(".keras"):
        parser.error(f"MODEL must be an existing .keras file; got {args.model!r}")
    if os.path.exists(args.out_dir) and not args.overwrite:
        parser.error(f"OUT_DIR {args.out_dir!r} already exists; pass --overwrite to replace it")
    if args.int8_tflite is not None and not args.representative_data:
        parser.error("--int8-tflite needs --representative-data X.npy (inputs that calibrate the int8 ranges)")
    import numpy as np

    import tf_hwopt.models  # noqa: F401  (registers the package's custom layers)
    from tf_hwopt.export import export_saved_model
    from tf_hwopt._quiet import import_tensorflow_quietly

    import_tensorflow_quietly()
    import keras

    model = keras.saving.load_model(args.model, compile=False)
    representative = np.load(args.representative_data) if args.representative_data else None
    tflite = None
    if args.int8_tflite is not None:
        tflite = args.int8_tflite or os.path.abspath(args.out_dir).rstrip(os.sep) + ".tflite"
    result = export_saved_model(
        model,
        args.out_dir,
        overwrite=args.overwrite,
        sample=None if representative is None else representative[:8],
        int8_tflite=tflite,
        representative_data=representative,
    )
    print(json.dumps(result.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
