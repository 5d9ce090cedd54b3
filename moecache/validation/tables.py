"""The validation artifact's tables: `runs.parquet` (one row per workload x strategy x capacity, and
one per workload for the unmodified model), `latency.parquet` (every generated token's latency),
`agreement.parquet` (output agreement: per workload, transformers' implementations against its default
grouped_mm path, the baseline, then every offloaded run; moecache/validation/agreement_runs.py) and `fidelity.parquet` (each
offloaded run predicted on profiles fitted elsewhere, marked fitted or predicted;
moecache/validation/holdout.py)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

RUNS_SCHEMA = pa.schema(
    [
        ("workload", pa.string()),
        ("strategy", pa.string()),
        ("policy", pa.string()),
        ("on_miss", pa.string()),
        ("capacity", pa.string()),
        ("slots", pa.int64()),
        ("capacity_fraction", pa.float64()),
        ("loop", pa.string()),  # transformers | fast-graphs | fast-eager (generation.py)
        ("reference", pa.bool_()),  # the run the others are compared with
        ("requests", pa.int64()),
        ("prompt_tokens", pa.int64()),
        ("generated_tokens", pa.int64()),
        ("warmup_gaps", pa.int64()),  # the fast loop's warm-up gaps, left out of the latencies below
        ("warmup_gaps_ms", pa.list_(pa.float64())),  # their durations (the decoder's first decode steps)
        ("ttft_ms", pa.float64()),
        ("itl_p50_ms", pa.float64()),
        ("itl_p90_ms", pa.float64()),
        ("itl_p99_ms", pa.float64()),
        ("decode_tokens_per_s", pa.float64()),
        ("prefill_tokens_per_s", pa.float64()),
        ("time_per_token_ms", pa.float64()),
        # every repeat's time per token and hit rate, in the order they ran (validate.repeats; the row is
        # the median time's repeat: moecache/validation/repeats.py); one entry for a run measured once
        ("time_per_token_ms_repeats", pa.list_(pa.float64())),
        ("hit_rate_repeats", pa.list_(pa.float64())),
        # the fast loop's host points over the timed decode steps (runs._host_points; null elsewhere)
        ("decode_manager_us_per_visit", pa.float64()),
        ("decode_readback_wait_us_per_visit", pa.float64()),
        ("decode_cpu_path_us_per_call", pa.float64()),
        ("decode_cpu_exec_us_per_call", pa.float64()),  # of the CPU path, the executor's call alone
        ("decode_cpu_entries_per_call", pa.float64()),
        # host us from a deferred visit's last copy enqueue to the next layer's publication, mean over
        # the deferred visits that copied (the profile's runtime.publish_lag; null: none copied)
        ("decode_publish_lag_us", pa.float64()),
        # the CPU probe timed just before the run against the cost profile's, % (machine_check.RunProbe;
        # null without a profile)
        ("cpu_probe_change_pct", pa.float64()),
        ("peak_cpu_rss_bytes", pa.int64()),
        ("peak_cuda_bytes", pa.int64()),
        ("hit_rate", pa.float64()),
        ("accesses", pa.int64()),
        ("hits", pa.int64()),
        ("misses", pa.int64()),
        ("copies", pa.int64()),
        ("copy_bytes", pa.int64()),
        ("late_copies", pa.int64()),
        ("waited_copies", pa.int64()),
        ("cpu_fallbacks", pa.int64()),
        ("gpu_entries", pa.int64()),
        ("trace", pa.string()),
        ("trace_source", pa.string()),  # recorded (hooks) | forcing trace (the fast loop)
        ("forced_rows_checked", pa.int64()),  # fast loop: visit rows checked against the forcing trace
        ("predicted_hit_rate", pa.float64()),
        ("predicted_time_per_token_ms", pa.float64()),
        ("fidelity_errors", pa.string()),
        # the same with the profile's decode anchors moved onto this validate's all_resident / all_cpu runs
        # (moecache/validation/anchors.py; null without both runs or a step=fast profile)
        ("fidelity_errors_anchored", pa.string()),
        ("anchored_profile", pa.string()),
    ]
)
LATENCY_SCHEMA = pa.schema(
    [
        ("workload", pa.string()),
        ("strategy", pa.string()),
        ("capacity", pa.string()),
        ("slots", pa.int64()),
        ("request_id", pa.string()),
        ("token_index", pa.int32()),  # 0: time to first token; later: the gap since the previous token
        ("latency_ms", pa.float64()),
        ("warmup", pa.bool_()),  # a fast-loop warm-up gap (eager step, graph capture)
    ]
)


AGREEMENT_SCHEMA = pa.schema(
    [
        ("workload", pa.string()),
        ("run", pa.string()),  # a transformers implementation (kind tolerance) or a strategy (kind moecache)
        ("kind", pa.string()),  # baseline (with a float32 truth) | tolerance | moecache
        ("capacity", pa.string()),  # as in runs.parquet (null for a tolerance row)
        ("slots", pa.int64()),
        ("baseline", pa.string()),  # the implementation every row is compared with: grouped_mm
        ("requests", pa.int64()),
        ("positions", pa.int64()),  # teacher-forced positions: prompt + fed tokens, over the requests
        ("max_abs_logit_error", pa.float64()),
        ("mean_abs_logit_error", pa.float64()),
        ("top1_agreement", pa.float64()),
        # moecache rows: each figure within every tolerance row's of the workload (null for those rows)
        ("max_abs_logit_error_within", pa.bool_()),
        ("mean_abs_logit_error_within", pa.bool_()),
        ("top1_agreement_within", pa.bool_()),
        ("within_tolerance", pa.bool_()),
        # against the float32 truth (validate.agreement_float32: the eager loop on the model widened to
        # float32); null without it
        ("float32_max_abs_logit_error", pa.float64()),
        ("float32_mean_abs_logit_error", pa.float64()),
        ("float32_top1_agreement", pa.float64()),
        # moecache rows: every float32 figure within the spread of the baseline's and tolerance rows'
        ("within_float32_spread", pa.bool_()),
        ("gpu_entries", pa.int64()),  # (token, k) entries of the teacher-forced pass from the slot pool
        ("cpu_entries", pa.int64()),  # ... and on the CPU
    ]
)
FIDELITY_SCHEMA = pa.schema(
    [
        ("direction", pa.string()),  # "<fit_on, or calibrate / no cost profile> -> <workload>"
        ("fit_on", pa.string()),  # the workload whose all_resident / all_cpu runs anchored the profile;
        # null: validate.cost_profile as given (calibrate's own runs)
        ("profile", pa.string()),  # that profile (an anchored one relative to the artifact)
        ("workload", pa.string()),
        ("strategy", pa.string()),
        ("capacity", pa.string()),
        ("slots", pa.int64()),
        ("role", pa.string()),  # fitted (an anchor of fit_on) | predicted
        ("measured_time_per_token_ms", pa.float64()),
        ("predicted_time_per_token_ms", pa.float64()),
        ("time_per_token_error_pct", pa.float64()),
        ("time_within_target", pa.bool_()),
        ("measured_hit_rate", pa.float64()),
        ("predicted_hit_rate", pa.float64()),
        ("hit_rate_error_pp", pa.float64()),
        ("hit_rate_within_target", pa.bool_()),
        ("cpu_probe_change_pct", pa.float64()),  # the run's (runs.parquet): the machine before it
    ]
)


def write(
    folder: Path, runs: list[dict], latencies: list[dict], agreement: list[dict], fidelity: list[dict]
) -> None:
    pq.write_table(pa.Table.from_pylist(runs, schema=RUNS_SCHEMA), folder / "runs.parquet")
    pq.write_table(pa.Table.from_pylist(latencies, schema=LATENCY_SCHEMA), folder / "latency.parquet")
    pq.write_table(pa.Table.from_pylist(agreement, schema=AGREEMENT_SCHEMA), folder / "agreement.parquet")
    pq.write_table(pa.Table.from_pylist(fidelity, schema=FIDELITY_SCHEMA), folder / "fidelity.parquet")
