"""`python -m tools.bench [MODE ...] [options]`: the command line of the benchmarks, each MODE's
table in turn from its own file (tools/bench/MODE.py); `--help` lists the modes and options."""
import argparse
import sys

from tools import bench
from tools.bench.decode_step import bench_decode_step
from tools.bench.engines import bench_engines
from tools.bench.flops import bench_flops
from tools.bench.generate import bench_rollout
from tools.bench.gpu import GPU_PARTS, bench_gpu
from tools.bench.grader import bench_reward
from tools.bench.grader_compare import bench_grader_compare
from tools.bench.logprobs import bench_model
from tools.bench.preempt import bench_preempt
from tools.bench.train_step import bench_train_step
from tools.bench.update import bench_update

BENCHES = {"logprobs": bench_model, "generate": bench_rollout, "grader": bench_reward,
           "grader-compare": bench_grader_compare, "update": bench_update,
           "gpu": bench_gpu, "engines": bench_engines, "train-step": bench_train_step,
           "flops": bench_flops, "preempt": bench_preempt, "decode-step": bench_decode_step}


def main(argv: list[str] | None = None) -> None:
    """`python -m tools.bench [MODE ...] [options]`: each MODE's table in turn (default: every mode
    but gpu)."""
    parser = argparse.ArgumentParser(prog="tools.bench", description=bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modes", nargs="*", metavar="MODE",
                        help=f"{', '.join(BENCHES)} (default: all but gpu)")
    parser.add_argument("--smoke", action="store_true",
                        help="gpu: the same code at toy shapes on the CPU")
    parser.add_argument("--out", metavar="DIR", help="gpu: also write DIR/gpu.md and DIR/gpu.json")
    parser.add_argument("--parts", type=lambda text: text.split(","), default=GPU_PARTS,
                        help=f"gpu: some of its parts, comma-separated ({','.join(GPU_PARTS)})")
    parser.add_argument("--against", metavar="FILE",
                        help="grader-compare: also another reward.py; engines: also another "
                        "rollout.py (the code before a change)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="engines: the tables of one process at N threads (without it, "
                        "engines starts one process per thread count)")
    args = parser.parse_intermixed_args(argv)
    unknown = [n for n in args.modes if n not in BENCHES]
    if unknown:
        sys.exit(f"tools.bench: unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHES)}")
    options = {"gpu": dict(smoke=args.smoke, out=args.out, parts=args.parts),
               "engines": dict(against=args.against, one=args.threads),
               "grader-compare": dict(against=args.against)}
    # `gpu` needs a GPU: only when named
    for name in args.modes or [n for n in BENCHES if n != "gpu"]:
        print(f"\n## {name}\n", flush=True)
        BENCHES[name](**options.get(name, {}))


if __name__ == "__main__":
    main()
