"""End-to-end simulator speed through the CLI: accesses per second of `moecache simulate` from a cold
process, the fixed start-up cost subtracted.

Builds two canonical traces from one imported trace (default: the DeepSeek-V2-Lite law trace): BIG, the
trace repeated `--repeat` times as one trace (request ids rewritten `<id>#rep<NN>` so that every
request is distinct), and SMALL, its first request alone. Then runs `moecache simulate traces=[<file>]
policy=lru capacity=416 sim.mode=instant force=true` in fresh processes, alternating SMALL and BIG
`--rounds` times, and reports accesses(BIG) / (median wall BIG - median wall SMALL): the simulator's
throughput end to end (trace loading, replay, metrics, artifact writing) without the process start-up,
imports and config composition, which SMALL pays as well. SMALL's median wall is itself the cold-start
figure. Also reports the CPU time (user + system) of each process, the same figure on a machine
shared with other work. Prints a table and ends with one JSON line.

    python benchmarks/bench_cli_sim.py [--trace <trace.parquet>] [--repeat 32] [--rounds 3]

Default trace: the newest import_trace artifact under outputs/ named `esft_law` (`moecache
import-trace trace_import.name=esft_law ...`), else the newest import_trace artifact.

The CLI runs with MOECACHE_OUTPUT_ROOT set to a temporary folder (unless --output-root is given), so
the benchmark never touches outputs/. The traces are written to --work (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq


def repeated_table(table: pa.Table, repeat: int) -> pa.Table:
    """`table` `repeat` times, one after another, each copy's request ids suffixed `#rep<NN>`."""
    column = table.schema.get_field_index("request_id")
    copies = []
    for i in range(repeat):
        ids = pc.binary_join_element_wise(table["request_id"], pa.scalar(f"rep{i:02d}"), "#")
        copies.append(table.set_column(column, table.schema.field(column), ids))
    return pa.concat_tables(copies)


def first_request(table: pa.Table) -> pa.Table:
    """The rows of the table's first request (rows of one request are contiguous in a canonical trace)."""
    first = table["request_id"][0]
    return table.filter(pc.equal(table["request_id"], first))


def build_traces(source: Path, work: Path, repeat: int) -> tuple[Path, Path]:
    """(BIG, SMALL) Parquet files under `work`, with `source`'s schema and trace metadata."""
    pf = pq.ParquetFile(source)
    table = pf.read()
    schema = pf.schema_arrow
    big, small = work / f"repeat{repeat}.parquet", work / "one_request.parquet"
    pq.write_table(repeated_table(table, repeat).cast(schema), big)
    pq.write_table(first_request(table).cast(schema), small)
    return big, small


def accesses(path: Path) -> int:
    """Distinct experts per (request, step, layer) summed: the simulator's access count."""
    from moecache.sim.trace_arrays import load_trace

    return load_trace(path).num_accesses


def default_trace(name: str) -> str:
    """The newest import_trace artifact's trace named `name`, else the newest one's."""
    found = sorted(glob.glob("outputs/import_trace/*/trace.parquet"), key=os.path.getmtime)
    if not found:
        raise SystemExit("bench_cli_sim: no import_trace artifact under outputs/; pass --trace")
    named = [p for p in found if _artifact_name(Path(p).parent) == name]
    return (named or found)[-1]


def _artifact_name(folder: Path) -> str | None:
    try:
        return json.loads((folder / "manifest.json").read_text())["config"].get("name")
    except (OSError, ValueError, KeyError, AttributeError):
        return None


def run_cli(trace: Path, output_root: str, capacity: int, policy: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of one cold `moecache simulate` process."""
    cmd = [
        sys.executable, "-m", "moecache.cli", "simulate", f"traces=[{trace}]", f"policy={policy}",
        f"capacity={capacity}", "sim.mode=instant", "force=true",
    ]  # fmt: skip
    env = {**os.environ, "MOECACHE_OUTPUT_ROOT": output_root}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"bench_cli_sim: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def rate_maps(accesses: int, seconds: float) -> float:
    """Million accesses per second; inf when the difference of times is not positive."""
    return accesses / seconds / 1e6 if seconds > 0 else float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="canonical trace Parquet (default: see the docstring)")
    ap.add_argument("--name", default="esft_law", help="import_trace name the default trace has")
    ap.add_argument("--repeat", type=int, default=32)
    ap.add_argument("--capacity", type=int, default=416)
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default=None, help="folder for the built traces (default: a temporary one)")
    ap.add_argument(
        "--output-root", default=None, help="MOECACHE_OUTPUT_ROOT of the runs (default: temporary)"
    )
    args = ap.parse_args()
    source = args.trace or default_trace(args.name)
    with tempfile.TemporaryDirectory(prefix="bench_cli_sim-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        root = args.output_root or str(Path(tmp) / "outputs")
        big, small = build_traces(Path(source), work, args.repeat)
        n_big, n_small = accesses(big), accesses(small)
        run_cli(small, root, args.capacity, args.policy)  # fills numba's disk cache if it is empty
        walls: dict[str, list[float]] = {"small": [], "big": []}
        cpus: dict[str, list[float]] = {"small": [], "big": []}
        for _ in range(args.rounds):
            for name, path in (("small", small), ("big", big)):
                wall, cpu = run_cli(path, root, args.capacity, args.policy)
                walls[name].append(wall)
                cpus[name].append(cpu)
    median = {name: statistics.median(walls[name]) for name in walls}
    median_cpu = {name: statistics.median(cpus[name]) for name in cpus}
    rate = rate_maps(n_big - n_small, median["big"] - median["small"])
    rate_cpu = rate_maps(n_big - n_small, median_cpu["big"] - median_cpu["small"])
    print(f"source {source}; {args.policy} capacity {args.capacity}, sim.mode=instant, force=true")
    print(f"{'trace':<6} | {'accesses':>12} | {'median wall s':>13} | {'median CPU s':>12} | walls s")
    for name, n in (("small", n_small), ("big", n_big)):
        runs = ", ".join(f"{w:.2f}" for w in walls[name])
        print(f"{name:<6} | {n:>12,} | {median[name]:13.3f} | {median_cpu[name]:12.3f} | {runs}")
    print(f"end to end: {rate:.1f} M accesses/s wall, {rate_cpu:.1f} M accesses/s CPU (target >= 15, wall)")
    print(
        json.dumps(
            {
                "bench": "cli_simulate",
                "source": source,
                "policy": args.policy,
                "capacity": args.capacity,
                "repeat": args.repeat,
                "accesses_big": n_big,
                "accesses_small": n_small,
                "wall_big_s": walls["big"],
                "wall_small_s": walls["small"],
                "cpu_big_s": cpus["big"],
                "cpu_small_s": cpus["small"],
                "end_to_end_maps": rate,
                "end_to_end_cpu_maps": rate_cpu,
            }
        )
    )


if __name__ == "__main__":
    main()
