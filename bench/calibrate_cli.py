"""`kvgate calibrate`'s command line: probe through a worker's step log (bench/calibrate.py), or
with requests alone for a server without one (bench/calibrate_requests.py, vLLM), and write the
profile. Kept apart from both so that neither module imports the other's caller."""

import argparse
import json
import sys

from bench import calibrate as steps
from bench import calibrate_requests as requests
from gateway.procs import Worker
from workers.cli_help import HelpFormatter


def rescale_main(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if not args.url:
        p.error("--rescale reads the step logs of running workers: give --url")
    with open(args.rescale) as f:
        profile = json.load(f)
    logged = [s for u in args.url for s in steps.step_log(u.rstrip("/"), args.after)[1]]
    if not logged:
        sys.exit("kvgate calibrate: the workers have logged no steps to rescale by")
    out = steps.rescale(profile, logged)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(json.dumps(out["rescaled"]), file=sys.stderr)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgate calibrate", description=steps.__doc__, formatter_class=HelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--url", action="append", help="a running worker; repeat to measure several at once (pooled into one profile)"
    )
    target.add_argument("--model", help="start `kvgate worker --model MODEL` for the measurement")
    p.add_argument("--executor", default="torch", help="with --model: the worker's executor")
    p.add_argument("--worker-arg", action="append", default=[], help="with --model: extra worker flag (repeatable)")
    p.add_argument("--lengths", default="16,32,64,128,256,512", help="prefill lengths (tokens)")
    p.add_argument(
        "--batches",
        default="1,2,3,4,5,6,7,8",
        help="decode batch sizes (the profile's decode_batch_ms covers 1 to the largest)",
    )
    p.add_argument("--decode-tokens", type=int, default=24, help="tokens each decode probe generates")
    p.add_argument("--rounds", type=int, default=3, help="repeats of every probe (each probe's median is fitted)")
    p.add_argument("--seed", type=int, default=0, help="seed of the probes' random prompts")
    p.add_argument(
        "--rescale",
        metavar="PROFILE",
        help="with --url: no probes; rescale PROFILE's speed to the workers' logged steps of real traffic",
    )
    p.add_argument("--after", type=int, default=0, help="with --rescale: only the steps numbered above this")
    p.add_argument("--out", required=True, help="profile JSON (a -fit.png plot is written next to it)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.rescale:
        rescale_main(args, p)
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    proc = None
    urls = args.url
    if args.model:
        proc = Worker(args.executor, "calibrate", model=args.model, extra=args.worker_arg).ready(300)
        urls = [proc.url]
    try:
        urls = [u.rstrip("/") for u in urls]
        probe = steps.calibrate
        if not requests.has_step_log(urls[0]):  # vLLM: no /steps, requests alone
            print(f"  {urls[0]} has no step log (GET /steps): probing with requests only", file=sys.stderr)
            probe = requests.calibrate
        profile = probe(urls, lengths, batches, args.decode_tokens, args.seed, args.rounds)
    finally:
        if proc is not None:
            proc.stop()
    with open(args.out, "w") as f:
        json.dump(profile, f, indent=1)
        f.write("\n")
    steps.plot_fit(profile, args.out[:-5] + "-fit.png" if args.out.endswith(".json") else args.out + "-fit.png")
    print(
        json.dumps(
            {k: profile[k] for k in (*steps.COLUMNS, "step_overhead_ms", "request_overhead_ms", "fit_rel_rmse")}
        ),
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
