"""A measured cost profile (`cost_profile.json`, written by `moecache calibrate`) as costs the simulator can ask.

    profile = CostProfile.load("outputs/calibrate/<id>/cost_profile.json")
    profile.cpu_expert_us(tokens=3)            # one expert on the CPU, 3 tokens, the model's dtype
    profile.copy_us(profile.expert_bytes)      # one pinned host-to-device copy of an expert
    profile.cuda_expert_us(1)                  # None when the profile was measured without a GPU

Expert times are the measured medians made non-decreasing in tokens per call (isotonic regression: noise
must not make more tokens look cheaper; the raw rows stay in `cpu`/`cuda`), interpolated linearly between
the measured points and extrapolated from the last two past the largest; copy times come from the latency + bytes / bandwidth fit of the
pinned copies, so any size can be costed.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

from moecache.errors import MoecacheError

PROFILE_FILE = "cost_profile.json"
SCHEMA_VERSION = 1  # the version `moecache.stages.calibrate` writes

_TOP_KEYS = ("schema_version", "shape", "dtype", "machine", "cpu", "cuda", "h2d", "measured_at")
_SHAPE_KEYS = ("hidden_size", "moe_intermediate_size", "expert_bytes")
_EXPERT_ROW_KEYS = ("dtype", "tokens_per_call", "median_us", "p10_us", "p90_us", "pool_experts")
_COPY_ROW_KEYS = ("bytes", "median_us", "gbps")
_H2D_KEYS = ("pinned", "pageable", "fit")
_FIT_KEYS = ("latency_us", "gbps")


def _require(obj, keys: tuple[str, ...], where: str, source: str) -> None:
    if not isinstance(obj, dict):
        raise MoecacheError(f"{source}: '{where or 'top level'}' must be an object, got {type(obj).__name__}")
    for key in keys:
        if key not in obj:
            raise MoecacheError(f"{source}: missing key '{where + '.' if where else ''}{key}'")


def _require_rows(rows, keys: tuple[str, ...], where: str, source: str) -> None:
    if not isinstance(rows, list) or not rows:
        raise MoecacheError(f"{source}: '{where}' must be a non-empty list")
    for n, row in enumerate(rows):
        _require(row, keys, f"{where}[{n}]", source)


def _non_decreasing(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Isotonic regression (pool adjacent violators) of y over sorted x: measurement noise must not make
    more tokens per call look cheaper. Violating neighbours are replaced by their mean."""
    blocks: list[list[float]] = []  # [sum of y, count]
    for _, y in points:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [total / count for total, count in blocks for _ in range(int(count))]
    return [(x, y) for (x, _), y in zip(points, fitted, strict=True)]


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points; flat below the first, linear extrapolation above the last."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if len(points) == 1:
        return points[0][1] * x / xs[0]
    i = min(bisect_left(xs, x), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    slope = (y1 - y0) / (x1 - x0)
    if x > x1:  # past the largest measured point: never let noise make more tokens cheaper
        slope = max(slope, 0.0)
    return y0 + slope * (x - x0)


@dataclass(frozen=True)
class CostProfile:
    """Measured constants of one machine for one expert shape."""

    shape: dict
    dtype: str
    machine: dict
    cpu: list[dict]
    cuda: list[dict] | None
    h2d: dict | None
    measured_at: str
    measure_s: float | None = None
    source: str = "<dict>"

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        path = Path(path)
        if path.is_dir():
            path = path / PROFILE_FILE
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise MoecacheError(f"cannot read cost profile {path}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise MoecacheError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> CostProfile:
        _require(data, _TOP_KEYS, "", source)
        if data["schema_version"] != SCHEMA_VERSION:
            raise MoecacheError(
                f"{source}: schema_version {data['schema_version']}, expected {SCHEMA_VERSION}"
            )
        _require(data["shape"], _SHAPE_KEYS, "shape", source)
        _require_rows(data["cpu"], _EXPERT_ROW_KEYS, "cpu", source)
        if data["cuda"] is not None:
            _require_rows(data["cuda"], _EXPERT_ROW_KEYS, "cuda", source)
        if data["h2d"] is not None:
            _require(data["h2d"], _H2D_KEYS, "h2d", source)
            _require_rows(data["h2d"]["pinned"], _COPY_ROW_KEYS, "h2d.pinned", source)
            _require_rows(data["h2d"]["pageable"], _COPY_ROW_KEYS, "h2d.pageable", source)
            _require(data["h2d"]["fit"], _FIT_KEYS, "h2d.fit", source)
        return cls(
            shape=data["shape"],
            dtype=data["dtype"],
            machine=data["machine"],
            cpu=data["cpu"],
            cuda=data["cuda"],
            h2d=data["h2d"],
            measured_at=data["measured_at"],
            measure_s=data.get("measure_s"),
            source=source,
        )

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert in the model's weight dtype (`dtype`)."""
        return int(self.shape["expert_bytes"])

    def dtypes(self, where: str = "cpu") -> list[str]:
        rows = self.cpu if where == "cpu" else (self.cuda or [])
        return list(dict.fromkeys(r["dtype"] for r in rows))

    def _expert_us(self, rows: list[dict], where: str, tokens: float, dtype: str | None) -> float:
        dtype = dtype or self.dtype
        points = sorted((r["tokens_per_call"], r["median_us"]) for r in rows if r["dtype"] == dtype)
        if not points:
            raise MoecacheError(
                f"{self.source}: no {where} expert timings for dtype {dtype} (has {self.dtypes(where)})"
            )
        if tokens <= 0:
            return 0.0
        return _interpolate(_non_decreasing(points), tokens)

    def cpu_expert_us(self, tokens: float, dtype: str | None = None) -> float:
        """Median microseconds of one expert call on the CPU for `tokens` tokens (weights cold)."""
        return self._expert_us(self.cpu, "cpu", tokens, dtype)

    def cuda_expert_us(self, tokens: float, dtype: str | None = None) -> float | None:
        """Median microseconds of one expert call on the GPU, or None when not measured (no GPU, or not that dtype)."""
        if self.cuda is None or (dtype or self.dtype) not in self.dtypes("cuda"):
            return None
        return self._expert_us(self.cuda, "cuda", tokens, dtype)

    def _need_h2d(self) -> dict:
        if self.h2d is None:
            raise MoecacheError(
                f"{self.source}: no host-to-device copy timings (calibrated without CUDA); use a profile"
                " calibrated with device=cuda"
            )
        return self.h2d

    def copy_us(self, nbytes: int) -> float:
        """Microseconds of one pinned host-to-device copy of `nbytes`, from the latency/bandwidth fit."""
        if nbytes <= 0:
            return 0.0
        fit = self._need_h2d()["fit"]
        return fit["latency_us"] + nbytes / (fit["gbps"] * 1e3)

    def expert_copy_us(self) -> float:
        """`copy_us` of one expert in the model's dtype."""
        return self.copy_us(self.expert_bytes)

    def pinned_at(self, nbytes: int) -> dict:
        """The measured pinned-copy row of exactly `nbytes` (the calibration always measures one expert's bytes)."""
        for row in self._need_h2d()["pinned"]:
            if row["bytes"] == nbytes:
                return row
        raise MoecacheError(f"{self.source}: no pinned copy of exactly {nbytes} bytes was measured")
