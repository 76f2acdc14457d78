"""Are the real SGLang server's iterations during a rollout as fast as the calibration probes say? The server's
own per-iteration log against the cost file's fit, per policy.

    .venv/bin/python bench/sglang_iterations.py [--workload tool-heavy] [--schedulers sync,async]
                                                [--cost bench/results/cost-sglang-tiny.json] [--out bench/results]

Starts one CPU server with ``--decode-log-interval 1`` (SGLang then logs every decode iteration: running
requests, KV tokens, and the throughput since the previous log), runs ``rollopt bench --engine servers`` against
it once per policy, and keeps the decode iterations with no prefill logged since the previous one: for those the
time since the previous log is one decode iteration (and the server's output processing, which the probes also
pay). Each is compared with the fit's price for the same batch and KV (``fixed + per_decode_seq · rows +
per_kv_token · tokens``). A ratio above 1 is time the probes, which run with the client idle, did not see.
Writes ``sglang-iterations-<workload>.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

DECODE = re.compile(r"Decode batch, #running-req: (\d+), #token: (\d+).*gen throughput \(token/s\): ([\d.]+)")
MARK = "=== rollopt policy "


def decode_iterations(log: Path) -> dict[str, list[tuple[int, int, float]]]:
    """Per policy (in the order run): (running requests, KV tokens, seconds) of each decode iteration logged with
    no prefill batch since the previous decode log."""
    found: dict[str, list[tuple[int, int, float]]] = {}
    policy, clean = None, False
    for line in log.read_text().splitlines():
        if line.startswith(MARK):
            policy, clean = line[len(MARK):].strip(), False
            found[policy] = []
        elif policy is not None and "Prefill batch" in line:
            clean = False
        elif policy is not None and (m := DECODE.search(line)):
            rows, tokens, throughput = int(m[1]), int(m[2]), float(m[3])
            if clean and throughput > 0:
                found[policy].append((rows, tokens, rows / throughput))
            clean = True
    return found


def compare(iterations: list[tuple[int, int, float]], coefficients: dict[str, float]) -> dict:
    c = coefficients
    fitted = [c["fixed_s"] + c["per_decode_seq_s"] * rows + c["per_kv_token_s"] * tokens
              for rows, tokens, _ in iterations]
    ratios = [s / f for (_, _, s), f in zip(iterations, fitted)]
    deciles = statistics.quantiles(ratios, n=10)
    by_batch = {f"{lo}-{hi - 1}": statistics.median(r for (rows, _, _), r in zip(iterations, ratios) if lo <= rows < hi)
                for lo, hi in ((1, 8), (8, 32), (32, 65)) if any(lo <= rows < hi for rows, _, _ in iterations)}
    return {"iterations": len(iterations), "mean_rows": statistics.mean(r for r, _, _ in iterations),
            "measured_s": sum(s for _, _, s in iterations), "fitted_s": sum(fitted),
            "ratio_median": statistics.median(ratios), "ratio_p10": deciles[0], "ratio_p90": deciles[-1],
            "ratio_median_by_rows": by_batch}


def main() -> None:
    from rollopt.engines.sglang_server import SGLangServer
    from rollopt.modeling import load_model
    from rollopt.modeling.loading import save_hf_dir
    from rollopt.schedulers import split_specs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="tool-heavy")
    parser.add_argument("--schedulers", default="sync,async")
    parser.add_argument("--cost", type=Path, default=Path("bench/results/cost-sglang-tiny.json"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    coefficients = json.loads(args.cost.read_text())["coefficients"]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        model_dir = save_hf_dir(load_model("tiny"), Path(tmp) / "model")
        makespans = {}
        with SGLangServer(model_dir, extra_args=["--dtype", "float32", "--decode-log-interval", "1"],
                          log_path=log) as server:
            for policy in split_specs(args.schedulers):
                with log.open("a") as f:
                    f.write(f"{MARK}{policy}\n")
                report = Path(tmp) / f"{policy}.json"
                subprocess.run([".venv/bin/rollopt", "bench", "-q", "--engine", "servers", "--engine-option",
                                f'urls=["{server.base_url}"]', "--workload", args.workload, "--schedulers", policy,
                                "--repeats", "1", "--json", str(report)], check=True)
                makespans[policy] = json.loads(report.read_text())["policies"][0]["makespan_s"]
        results = {policy: {"makespan_s": makespans[policy], **compare(its, coefficients)}
                   for policy, its in decode_iterations(log).items()}
    out = {"workload": args.workload, "cost_file": str(args.cost), "date": time.strftime("%Y-%m-%d"),
           "policies": results}
    path = args.out / f"sglang-iterations-{args.workload}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    for policy, r in results.items():
        print(f"{policy:>24}: makespan {r['makespan_s']:.2f} s; {r['iterations']} clean decode iterations "
              f"(mean {r['mean_rows']:.1f} rows): measured {r['measured_s']:.2f} s against fitted "
              f"{r['fitted_s']:.2f} s, "
              f"median ratio {r['ratio_median']:.2f} [p10 {r['ratio_p10']:.2f}, p90 {r['ratio_p90']:.2f}]")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
