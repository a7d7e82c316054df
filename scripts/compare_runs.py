"""Whether run B follows run A's curve: loss and gradient norm step by step, the largest relative
differences, and a verdict against the tolerance the runs' precision allows (fp32 1e-4, with
experts 1e-3, bf16 5e-3 on the loss: what every layout holds against one process).

    python scripts/compare_runs.py outputs/llama_fsdp outputs/llama_tp2_pp4
    python scripts/compare_runs.py A B --steps 20   # the first 20 steps only
    python scripts/compare_runs.py A B --rtol 1e-3  # a tolerance of your own (gradient norm: 10x)

Exit 0: within the tolerance; 1: not (the first step outside is named); 2: bad input. Two runs
part slowly as their rounding differs, so compare the first steps of long runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.observe.compare import compare, read_run  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="a run's output_dir (the reference)")
    parser.add_argument("b", help="the run to check against it")
    parser.add_argument("--steps", type=int, help="compare steps 1..N only")
    parser.add_argument("--rtol", type=float,
                        help="the loss's relative tolerance (default: by precision)")
    args = parser.parse_args(argv)
    try:
        if Path(args.a).resolve() == Path(args.b).resolve():
            raise ValueError(f"{args.a} given twice: a run compared with itself is always the same "
                             "curve")
        a, b = read_run(args.a), read_run(args.b)
        result = compare(a, b, args.steps, args.rtol)
    except ValueError as e:
        print(f"compare_runs: {e}", file=sys.stderr)
        return 2
    print(f"A: {a.path} ({a.layout}, {a.precision})\nB: {b.path} ({b.layout}, {b.precision})")
    print(f"{'step':>6} {'loss A':>10} {'loss B':>10} {'rel. diff':>9} {'grad_norm rel. diff':>19}")
    for step, dl, dg in zip(result.steps, result.loss, result.grad_norm):
        print(f"{step:>6} {a.steps[step]['loss']:>10.5f} {b.steps[step]['loss']:>10.5f} {dl:>9.1e} "
              f"{dg:>19.1e}")
    largest = (f"largest relative difference: loss {max(result.loss):.1e}, gradient norm "
               f"{max(result.grad_norm):.1e}")
    tolerance = f"(tolerance {result.loss_rtol:.0e}, {result.grad_norm_rtol:.0e})"
    if result.within:
        print(f"same curve over {len(result.steps)} steps: {largest} {tolerance}")
        return 0
    print(f"different curves from step {result.first_outside()}: {largest} {tolerance}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
