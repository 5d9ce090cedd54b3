"""The report's figures: one function per figure, each writing one PNG and returning its path.

Each function takes the artifact table(s) it draws (all traces; it selects its trace), the trace name and the
output path. Degenerate input (no rows, a single capacity, no time estimate, nulls) draws a note in the axes
instead of failing. PNGs are written without a Software/date stamp so that the same input gives the same
bytes.

Legend: L layers, E experts per layer, C capacities, P policy labels, N keys (layer, expert) of a trace.
"""

from __future__ import annotations

import functools
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from moecache.analysis.frequency import cover  # noqa: E402  (the analysis's own definition)
from moecache.report.roles import (  # noqa: E402
    HIDDEN,
    OTHER_COLOR,
    ROLE_COLORS,
    ROLE_NAMES,
    ROLE_STYLES,
    ROLES,
    bound_labels,
)
from moecache.report.tables import curve_rows, floats, ints, labels_in_order, select  # noqa: E402

DPI = 110
STYLE = {
    "font.size": 8,
    "axes.titlesize": 9,
    "axes.labelsize": 8,
    "legend.fontsize": 6.5,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "figure.titlesize": 10,
}
VERDICTS = ("better", "equivalent", "non_inferior", "inconclusive", "worse")
VERDICT_COLORS = ("#1a9850", "#91cf60", "#d9ef8b", "#bdbdbd", "#d73027")
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")


def _styled(draw):
    """Run a figure function under the report's font sizes (rcParams are read when artists are made)."""

    @functools.wraps(draw)
    def wrapper(*args, **kwargs):
        with plt.rc_context(STYLE):
            return draw(*args, **kwargs)

    return wrapper


def _figure(width: float, height: float):
    return plt.figure(figsize=(width, height), layout="constrained")


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    return path


def _integer_ticks(*axes) -> None:
    """Integer tick positions (capacities, layers, experts, counts of keys) on the given Axis objects."""
    for axis in axes:
        axis.set_major_locator(MaxNLocator(integer=True))


def _capacity_axis(ax, rows: pa.Table) -> None:
    """Integer capacity ticks; a single capacity gets one tick in the middle of the axis."""
    caps = np.unique(floats(rows, "capacity"))
    if len(caps) == 1:
        ax.set_xticks(caps)
        ax.set_xlim(caps[0] - 1.0, caps[0] + 1.0)
    else:
        _integer_ticks(ax.xaxis)


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=9, color="0.35")


def _curve(rows: pa.Table, label: str, column: str) -> tuple[np.ndarray, np.ndarray]:
    """Capacity and value of one label's rows, sorted by capacity, without null values (C,)."""
    sub = select(rows, label=label)
    cap_C = floats(sub, "capacity")
    val_C = floats(sub, column)
    keep = ~np.isnan(val_C) & ~np.isnan(cap_C)
    order = np.argsort(cap_C[keep], kind="stable")
    return cap_C[keep][order], val_C[keep][order]


def belady_bound(rows: pa.Table, specs: dict, column: str = "hit_rate"):
    """(capacity_C, value_C, the labels) of the offline bound: per capacity the best (highest hit rate,
    lowest time) over the bound's Belady labels (roles.bound_labels); None when none was swept."""
    chosen = [x for x in bound_labels(specs) if x in set(rows["label"].to_pylist())]
    if not chosen:
        return None
    better = max if column == "hit_rate" else min
    best: dict[float, float] = {}
    for label in chosen:
        for c, v in zip(*_curve(rows, label, column), strict=True):
            best[c] = better(best[c], v) if c in best else v
    if not best:
        return None
    cap_C = np.array(sorted(best))
    return cap_C, np.array([best[c] for c in cap_C]), ", ".join(chosen)


class CapacityScale:
    """x = capacity as a percentage of all (layer, expert) keys of the trace, from the sweep's
    capacity_fraction; slots on a secondary axis. Without that column: slots on the main axis."""

    def __init__(self, rows: pa.Table):
        self.keys = None
        if "capacity_fraction" in rows.column_names:
            cap_R, frac_R = floats(rows, "capacity"), floats(rows, "capacity_fraction")
            ok = (frac_R > 0) & ~np.isnan(frac_R)
            if ok.any():
                self.keys = float(np.round(np.median(cap_R[ok] / frac_R[ok])))

    def x(self, cap_C: np.ndarray) -> np.ndarray:
        return cap_C if self.keys is None else 100.0 * cap_C / self.keys

    def decorate(self, ax, rows: pa.Table, label_x: bool = True) -> None:
        caps = np.unique(floats(rows, "capacity"))
        if self.keys is None:
            if label_x:
                ax.set_xlabel("cache capacity (expert slots)")
            _capacity_axis(ax, rows)
            return
        if label_x:
            ax.set_xlabel(f"cache capacity (% of all {int(self.keys)} experts)")
        if len(caps) == 1:
            x = self.x(caps)[0]
            ax.set_xlim(x - 1.0, x + 1.0)
        keys = self.keys
        top = ax.secondary_xaxis("top", functions=(lambda p: p * keys / 100.0, lambda s: 100.0 * s / keys))
        top.set_xlabel("expert slots", fontsize=7)
        top.xaxis.set_major_locator(MaxNLocator(integer=True))


def _draw_curves(ax, rows: pa.Table, column: str, roles: dict[str, str], scale: CapacityScale) -> list:
    """One line per label: the decision's roles in colour (thick, labelled), every other label thin
    light grey under them (one legend entry). Returns the legend handles, in ROLES order."""
    others = [x for x in labels_in_order(rows) if x not in roles]
    grey = None
    for label in others:
        cap_C, y_C = _curve(rows, label, column)
        if len(cap_C):
            (grey,) = ax.plot(scale.x(cap_C), y_C, color=OTHER_COLOR, lw=0.8, zorder=1)
    handles = []
    ranked = sorted((x for x in roles if roles[x] not in HIDDEN), key=lambda x: (ROLES.index(roles[x]), x))
    for i, label in enumerate(ranked):
        cap_C, y_C = _curve(rows, label, column)
        if len(cap_C):
            role = roles[label]
            (line,) = ax.plot(
                scale.x(cap_C), y_C, color=ROLE_COLORS[role], ls=ROLE_STYLES.get(role, "-"), lw=1.8,
                marker=MARKERS[i % 8], ms=3.5, zorder=3 + len(ranked) - i, label=f"{ROLE_NAMES[role]}: {label}",
            )  # fmt: skip
            handles.append(line)
    if grey is not None:
        grey.set_label(f"other swept policies ({len(others)})")
        handles.append(grey)
    return handles


def _curves(sweep: pa.Table | None, trace: str, column: str, title: str, ylabel: str, roles: dict[str, str]):
    """(figure, axes, rows, scale, legend handles) of one sweep column vs capacity (base scales, timed
    mode when present); rows None when the trace has no sweep rows (a note is drawn)."""
    fig = _figure(9.0, 5.6)
    ax = fig.add_subplot()
    rows, mode = curve_rows(sweep, trace)
    ax.set_title(f"{title} — {trace} ({mode} replay)")
    ax.set_ylabel(ylabel)
    if rows is None or rows.num_rows == 0:
        ax.set_xlabel("cache capacity")
        _note(ax, "no sweep rows for this trace")
        return fig, ax, None, None, []
    scale = CapacityScale(rows)
    handles = _draw_curves(ax, rows, column, roles, scale)
    return fig, ax, rows, scale, handles


def _legend_below(fig, handles, ncol: int = 2) -> None:
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=ncol, frameon=False)


@_styled
def hit_rate_vs_capacity(
    sweep: pa.Table | None, trace: str, path: Path, roles: dict[str, str], specs: dict
) -> Path:
    """Hit rate vs capacity: the decision's policies in colour, the rest grey, the Belady bound dashed with
    the region above it (unreachable by demand caching) shaded."""
    fig, ax, rows, scale, handles = _curves(
        sweep, trace, "hit_rate", "Hit rate vs capacity", "hit rate (fraction of expert accesses)", roles
    )
    if rows is None:
        return _save(fig, path)
    bound = belady_bound(rows, specs)
    if bound is not None:
        cap_C, hit_C, source = bound
        x_C = scale.x(cap_C)
        if len(x_C) == 1:  # a single capacity: a narrow band around it
            x_C, hit_C = np.array([x_C[0] - 0.5, x_C[0] + 0.5]), np.repeat(hit_C, 2)
        ax.fill_between(x_C, hit_C, 1.02, color="0.6", alpha=0.2, hatch="//", lw=0, zorder=0)
        (line,) = ax.plot(x_C, hit_C, color=ROLE_COLORS["bound"], ls="--", lw=1.2, zorder=2,
                          label=f"Belady bound ({source}); shaded: only prefetching reaches it")  # fmt: skip
        handles.append(line)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    scale.decorate(ax, rows)
    _legend_below(fig, handles)
    return _save(fig, path)


@_styled
def ms_per_token_vs_capacity(
    sweep: pa.Table | None, trace: str, path: Path, roles: dict[str, str], specs: dict
) -> Path:
    """Estimated milliseconds per token vs capacity (the lines of hit_rate_vs_capacity; the Belady
    bound's time dashed)."""
    fig, ax, rows, scale, handles = _curves(
        sweep, trace, "est_ms_per_token", "Estimated time per token vs capacity",
        "estimated time per token (ms)", roles,
    )  # fmt: skip
    if rows is None:
        return _save(fig, path)
    if not handles:
        _note(ax, "no time estimate (est_ms_per_token is null in every row)")
        return _save(fig, path)
    bound = belady_bound(rows, specs, "est_ms_per_token")
    if bound is not None:
        cap_C, ms_C, source = bound
        (line,) = ax.plot(scale.x(cap_C), ms_C, color=ROLE_COLORS["bound"], ls="--", lw=1.2, zorder=2,
                          label=f"Belady ({source})")  # fmt: skip
        handles.append(line)
    ax.grid(alpha=0.3)
    scale.decorate(ax, rows)
    _legend_below(fig, handles)
    return _save(fig, path)


@_styled
def overview(
    sweep: pa.Table | None, traces: list[str], path: Path, roles: dict[str, str], specs: dict, useful
) -> Path:
    """Small multiples, one panel per trace: estimated time per token vs capacity, the decision's
    policies in colour, the rest grey, the useful range (`useful`: trace -> capacities judged) shaded."""
    n = max(len(traces), 1)
    ncol = min(n, 3)
    nrow = int(np.ceil(n / ncol))
    fig = _figure(max(4.2 * ncol + 0.6, 8.0), 3.3 * nrow + 1.6)
    fig.suptitle("Estimated time per token vs capacity: the decision's policies in colour, the rest grey")
    axes = fig.subplots(nrow, ncol, squeeze=False).ravel()
    handles: dict[str, object] = {}
    for ax, trace in zip(axes, traces, strict=False):
        rows, mode = curve_rows(sweep, trace)
        ax.set_title(f"{trace} ({mode})")
        if rows is None or rows.num_rows == 0:
            _note(ax, "no sweep rows")
            continue
        scale = CapacityScale(rows)
        for h in _draw_curves(ax, rows, "est_ms_per_token", roles, scale):
            handles.setdefault(h.get_label(), h)
        bound = belady_bound(rows, specs, "est_ms_per_token")
        if bound is not None:
            (line,) = ax.plot(scale.x(bound[0]), bound[1], color=ROLE_COLORS["bound"], ls="--", lw=1.2,
                              zorder=2, label=f"Belady ({bound[2]})")  # fmt: skip
            handles.setdefault(line.get_label(), line)
        caps = sorted(useful.get(trace) or [])
        if caps:
            lo, hi = scale.x(np.array([caps[0], caps[-1]], dtype=float))
            ax.axvspan(lo, hi, color="#fff2cc", alpha=0.6, zorder=0, lw=0)
        ax.grid(alpha=0.3)
        scale.decorate(ax, rows)
        ax.set_ylabel("est. ms per token")
    for ax in axes[len(traces) :]:
        ax.set_axis_off()
    span = Patch(color="#fff2cc", label="useful range (capacities judged)")
    _legend_below(fig, [*handles.values(), span], ncol=2 if ncol == 1 else 3)
    return _save(fig, path)


def _layer_matrix(rows: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Layers (L,), capacities (C,) and hit rate [L, C] (NaN where no row) of one label's per-layer rows."""
    layer_R = ints(rows, "layer")
    cap_R = ints(rows, "capacity")
    hit_R = floats(rows, "hit_rate")
    layers_L, li_R = np.unique(layer_R, return_inverse=True)
    caps_C, ci_R = np.unique(cap_R, return_inverse=True)
    hit_LC = np.full((len(layers_L), len(caps_C)), np.nan)
    hit_LC[li_R, ci_R] = hit_R
    return layers_L, caps_C, hit_LC


def _ticks(ax, axis: str, values: np.ndarray, most: int = 24) -> None:
    step = max(1, int(np.ceil(len(values) / most)))
    idx = np.arange(0, len(values), step)
    if axis == "x":
        ax.set_xticks(idx, [str(v) for v in values[idx]], rotation=90)
    else:
        ax.set_yticks(idx, [str(v) for v in values[idx]])


@_styled
def per_layer_heatmap(per_layer: pa.Table | None, trace: str, labels: list[str], path: Path) -> Path:
    """Per-layer hit rate (rows = layers, columns = capacities), one panel per label."""
    rows = select(per_layer, trace=trace)
    mode = "timed"
    if rows is not None:
        mode = "timed" if "timed" in set(rows["mode"].to_pylist()) else "instant"
        rows = select(rows, mode=mode)
    fig = _figure(5.0 * max(len(labels), 1) + 1.0, 5.0)
    fig.suptitle(f"Per-layer hit rate — {trace} ({mode} replay)")
    axes = fig.subplots(1, max(len(labels), 1), squeeze=False)[0]
    image = None
    for ax, label in zip(axes, labels, strict=False):
        sub = select(rows, label=label)
        ax.set_title(label)
        ax.set_xlabel("cache capacity (expert slots)")
        ax.set_ylabel("layer")
        if sub is None or sub.num_rows == 0:
            _note(ax, f"no per-layer rows for {label}")
            continue
        layers_L, caps_C, hit_LC = _layer_matrix(sub)
        image = ax.imshow(
            np.ma.masked_invalid(hit_LC), aspect="auto", origin="lower", cmap="viridis", vmin=0.0, vmax=1.0
        )
        _ticks(ax, "x", caps_C)
        _ticks(ax, "y", layers_L)
        if hit_LC.size <= 120:
            for (i, j), v in np.ndenumerate(hit_LC):
                if not np.isnan(v):
                    ax.text(
                        j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if v < 0.6 else "k"
                    )
    if image is not None:
        fig.colorbar(image, ax=list(axes), label="hit rate (fraction of the layer's accesses)", shrink=0.9)
    return _save(fig, path)


@_styled
def frequency_cdf(frequency: pa.Table | None, trace: str, path: Path) -> Path:
    """Cumulative share of selections vs number of keys (largest first): all layers, and each layer."""
    fig = _figure(11.0, 4.6)
    fig.suptitle(f"Expert-frequency concentration — {trace}")
    ax_g, ax_l = fig.subplots(1, 2)
    ax_g.set_title("all layers (keys = layer, expert)")
    ax_g.set_xlabel("number of keys, most used first")
    ax_g.set_ylabel("cumulative share of selections")
    ax_l.set_title("per layer")
    ax_l.set_xlabel("number of experts in the layer, most used first")
    ax_l.set_ylabel("cumulative share of the layer's selections")
    rows = select(frequency, trace=trace)
    count_N = ints(rows, "count") if rows is not None and rows.num_rows else np.zeros(0, np.int64)
    if count_N.sum() <= 0:
        _note(ax_g, "no selections")
        _note(ax_l, "no selections")
        return _save(fig, path)
    cum_N = np.cumsum(np.sort(count_N)[::-1]) / count_N.sum()
    x_N = np.arange(1, len(cum_N) + 1)
    ax_g.plot(x_N, cum_N, color="C0", lw=1.5, drawstyle="steps-post")
    for fraction, color in ((0.8, "C1"), (0.9, "C3")):
        k = cover(count_N, fraction)
        ax_g.axvline(
            k, color=color, ls="--", lw=1, label=f"cover_{int(fraction * 100)} = {k} of {len(count_N)} keys"
        )
        ax_g.axhline(fraction, color=color, ls=":", lw=0.8)
    ax_g.set_ylim(0, 1.02)
    ax_g.grid(alpha=0.3)
    _integer_ticks(ax_g.xaxis, ax_l.xaxis)
    ax_g.legend(loc="lower right")
    layer_R = ints(rows, "layer")
    layers = np.unique(layer_R)
    cmap = plt.get_cmap("viridis")
    for i, layer in enumerate(layers):
        c_E = count_N[layer_R == layer]
        if c_E.sum() <= 0:
            continue
        cum_E = np.cumsum(np.sort(c_E)[::-1]) / c_E.sum()
        ax_l.plot(
            np.arange(1, len(cum_E) + 1), cum_E, lw=0.8, alpha=0.8, color=cmap(i / max(len(layers) - 1, 1))
        )
    ax_l.set_ylim(0, 1.02)
    ax_l.grid(alpha=0.3)
    if len(layers):
        mappable = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(layers.min(), max(layers.max(), 1)))
        bar = fig.colorbar(mappable, ax=ax_l, label="layer")
        _integer_ticks(bar.ax.yaxis)
    return _save(fig, path)


def log_histogram(value_R: np.ndarray, count_R: np.ndarray, bins: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """Integer values >= 1 weighted by counts, in logarithmic bins: bin edges and the share per bin.
    E.g. values [1, 2, 3], counts [2, 1, 1] with edges [1, 2, 4]: shares [0.5, 0.5]."""
    top = max(int(value_R.max()) + 1, 2)
    edges = np.unique(np.floor(np.geomspace(1, top, bins + 1)).astype(np.int64))
    if edges[-1] < top:
        edges = np.append(edges, top)
    hist, _ = np.histogram(value_R, bins=edges, weights=count_R)
    return edges, hist / max(count_R.sum(), 1)


def _histogram_panel(ax, rows: pa.Table | None, column: str, what: str) -> None:
    if rows is None or rows.num_rows == 0:
        _note(ax, f"no {what}")
        return
    value_R = ints(rows, column)
    count_R = ints(rows, "count")
    keep = value_R >= 1
    value_R, count_R = value_R[keep], count_R[keep]
    if count_R.sum() <= 0:
        _note(ax, f"no {what}")
        return
    edges, share = log_histogram(value_R, count_R)
    ax.stairs(share, edges, fill=True, alpha=0.7, color="C0")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    at_one = count_R[value_R == 1].sum() / count_R.sum()
    ax.set_title(f"{ax.get_title()}; share at 1: {at_one:.3f}")


@_styled
def reuse_and_runs(reuse: pa.Table | None, runs: pa.Table | None, trace: str, path: Path) -> Path:
    """Reuse-distance histogram and run-length histogram (log-x), as shares of their totals."""
    fig = _figure(11.0, 4.3)
    fig.suptitle(f"Reuse distance and run length — {trace}")
    ax_r, ax_n = fig.subplots(1, 2)
    ax_r.set_title("reuse distance")
    ax_r.set_xlabel("reuse distance (tokens, log scale)")
    ax_r.set_ylabel("share of reuses")
    ax_n.set_title("run length")
    ax_n.set_xlabel("run length (consecutive tokens selecting the key, log scale)")
    ax_n.set_ylabel("share of runs")
    _histogram_panel(ax_r, select(reuse, trace=trace), "distance", "reuses")
    _histogram_panel(ax_n, select(runs, trace=trace), "run_length", "runs")
    return _save(fig, path)


def spaced_layers(layers: np.ndarray, most: int = 6) -> np.ndarray:
    """Up to `most` evenly spaced entries of a sorted array (first and last included)."""
    if len(layers) <= most:
        return layers
    return layers[np.unique(np.round(np.linspace(0, len(layers) - 1, most)).astype(np.int64))]


def row_normalised(from_R: np.ndarray, to_R: np.ndarray, count_R: np.ndarray, n: int) -> np.ndarray:
    """P(to | from) as an [n, n] matrix (rows = from); NaN rows where a from-expert has no transitions.
    E.g. counts (0->0: 1, 0->1: 3): row 0 = [0.25, 0.75], row 1 = NaN."""
    count_EE = np.zeros((n, n), dtype=np.float64)
    np.add.at(count_EE, (from_R, to_R), count_R)
    total_E = count_EE.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total_E > 0, count_EE / total_E, np.nan)


@_styled
def layer_transitions(
    transitions: pa.Table | None, layer_mi: pa.Table | None, trace: str, path: Path
) -> Path:
    """P(expert at layer l | expert at layer l-1) for up to 6 evenly spaced layers, and the mutual information
    between adjacent layers' choices (with its shuffled baseline) per layer."""
    rows = select(transitions, trace=trace)
    layers = np.unique(ints(rows, "layer")) if rows is not None and rows.num_rows else np.zeros(0, np.int64)
    shown = spaced_layers(layers)
    n_rows = max(1, int(np.ceil(len(shown) / 3)))
    fig = _figure(11.0, 3.3 * n_rows + 3.0)
    fig.suptitle(f"Adjacent-layer expert transitions — {trace}")
    grid = fig.add_gridspec(n_rows + 1, 3, height_ratios=[1.0] * n_rows + [0.8])
    heat_axes = [fig.add_subplot(grid[i // 3, i % 3]) for i in range(max(len(shown), 1))]
    if len(shown) == 0:
        _note(heat_axes[0], "no adjacent-layer transitions")
        heat_axes[0].set_axis_off()
    else:
        from_R, to_R, count_R = (ints(rows, c) for c in ("from_expert", "to_expert", "count"))
        layer_R = ints(rows, "layer")
        n = int(max(from_R.max(), to_R.max())) + 1
        mats = {
            int(x): row_normalised(from_R[layer_R == x], to_R[layer_R == x], count_R[layer_R == x], n)
            for x in shown
        }
        vmax = max(float(np.nanmax(m)) if np.isfinite(m).any() else 0.0 for m in mats.values()) or 1.0
        image = None
        for ax, layer in zip(heat_axes, shown, strict=True):
            image = ax.imshow(
                np.ma.masked_invalid(mats[int(layer)]),
                cmap="magma",
                vmin=0.0,
                vmax=vmax,
                interpolation="nearest",
            )
            ax.set_title(f"layer {layer - 1} → {layer}")
            ax.set_xlabel(f"expert at layer {layer}")
            ax.set_ylabel(f"expert at layer {layer - 1}")
            _integer_ticks(ax.xaxis, ax.yaxis)
        fig.colorbar(image, ax=heat_axes, label="P(to | from)", shrink=0.9)
    ax_mi = fig.add_subplot(grid[n_rows, :])
    ax_mi.set_title("mutual information between adjacent layers' expert choices")
    ax_mi.set_xlabel("layer (the later layer of the pair)")
    ax_mi.set_ylabel("mutual information (bits)")
    mi = select(layer_mi, trace=trace)
    if mi is None or mi.num_rows == 0:
        _note(ax_mi, "no layer mutual information")
    else:
        order = np.argsort(ints(mi, "layer"), kind="stable")
        layer_M = ints(mi, "layer")[order]
        ax_mi.plot(layer_M, floats(mi, "mi_bits")[order], "o-", ms=3, lw=1.2, label="observed")
        ax_mi.plot(
            layer_M, floats(mi, "mi_shuffled_bits")[order], "s--", ms=3, lw=1.0, label="shuffled baseline"
        )
        ax_mi.grid(alpha=0.3)
        ax_mi.legend(loc="best")
        _integer_ticks(ax_mi.xaxis)
        ax_mi.set_ylim(bottom=0.0)
        if len(layer_M) == 1:
            ax_mi.set_xlim(layer_M[0] - 1, layer_M[0] + 1)
    return _save(fig, path)


@_styled
def drift_and_convergence(
    window_drift: pa.Table | None, convergence: pa.Table | None, trace: str, path: Path
) -> Path:
    """JS divergence of each window vs the first (and its shuffled baseline), and how fast the ranking of
    keys by count converges (Spearman correlation vs tokens seen; top-C overlap per capacity)."""
    fig = _figure(11.0, 4.3)
    fig.suptitle(f"Drift and convergence — {trace}")
    ax_d, ax_c = fig.subplots(1, 2)
    ax_d.set_title("window drift")
    ax_d.set_xlabel("window start (token index)")
    ax_d.set_ylabel("JS divergence vs the first window (bits)")
    drift = select(window_drift, trace=trace)
    drawn = False
    if drift is not None and drift.num_rows:
        order = np.argsort(floats(drift, "token_start"), kind="stable")
        x = floats(drift, "token_start")[order]
        for column, style, name in (
            ("js_vs_first", "o-", "observed"),
            ("js_vs_first_shuffled", "s--", "shuffled"),
        ):
            y = floats(drift, column)[order]
            keep = ~np.isnan(y)
            if keep.any():
                ax_d.plot(x[keep], y[keep], style, ms=3, lw=1.2, label=name)
                drawn = True
    if drawn:
        ax_d.grid(alpha=0.3)
        ax_d.legend(loc="best")
    else:
        _note(ax_d, "no window drift")
    ax_c.set_title("convergence of the key ranking")
    ax_c.set_xlabel("tokens seen (log scale)")
    ax_c.set_ylabel("Spearman ρ vs the final ranking / top-C overlap")
    conv = select(convergence, trace=trace)
    drawn = False
    if conv is not None and conv.num_rows:
        seen = floats(conv, "tokens_seen")
        rho = floats(conv, "spearman")
        points = sorted({(s, r) for s, r in zip(seen, rho, strict=True) if s > 0 and not np.isnan(r)})
        first: dict[float, float] = {}
        for s, r in points:
            first.setdefault(s, r)
        if first:
            ax_c.plot(list(first), list(first.values()), "o-", ms=3, lw=1.4, color="k", label="Spearman ρ")
            drawn = True
        if "capacity" in conv.column_names and "overlap" in conv.column_names:
            cap = floats(conv, "capacity")
            overlap = floats(conv, "overlap")
            for i, c in enumerate(np.unique(cap[~np.isnan(cap)])):
                keep = (cap == c) & (seen > 0) & ~np.isnan(overlap)
                if keep.any():
                    order = np.argsort(seen[keep], kind="stable")
                    ax_c.plot(
                        seen[keep][order],
                        overlap[keep][order],
                        "--",
                        lw=1.0,
                        color=f"C{i % 10}",
                        label=f"overlap, C={int(c)}",
                    )
                    drawn = True
    if drawn:
        ax_c.set_xscale("log")
        ax_c.grid(alpha=0.3)
        ax_c.legend(loc="best")
    else:
        _note(ax_c, "no convergence rows")
    return _save(fig, path)


def decision_label(verdicts: pa.Table | None, decision: dict | None) -> str | None:
    """The candidate the first-part figure draws: the first-part selection when it is a candidate (it has
    verdict rows), else the first candidate of the verdicts (the most preferred)."""
    if verdicts is None:
        return None
    candidates = [
        str(label)
        for role, label in zip(verdicts["role"].to_pylist(), verdicts["label"].to_pylist(), strict=True)
        if role == "candidate" and label is not None
    ]
    first = ((decision or {}).get("first_part") or (decision or {}).get("selected") or {}).get("label")
    if first in candidates:
        return first
    return candidates[0] if candidates else None


@_styled
def decision_verdicts(verdicts: pa.Table | None, decision: dict | None, path: Path) -> Path:
    """Verdict grid (traces x capacities, colour = verdict, text = relative difference) and a forest plot of
    the relative difference with its confidence interval per cell, the ±margin band shaded."""
    label = decision_label(verdicts, decision)
    rule = (decision or {}).get("rule") or {}
    margin = rule.get("margin")
    rows = select(verdicts, label=label) if label is not None else None
    n_cells = rows.num_rows if rows is not None else 0
    fig = _figure(11.0, max(3.6, 0.16 * n_cells + 1.8))
    baseline = ((decision or {}).get("baseline") or {}).get("label", "the baseline")
    fig.suptitle(
        f"First part: {label or 'no candidate'} vs the baseline {baseline}, metric {rule.get('metric', 'n/a')}"
    )
    ax_g, ax_f = fig.subplots(1, 2, width_ratios=[1.0, 1.2])
    if rows is None or n_cells == 0:
        _note(ax_g, "no verdict rows")
        _note(ax_f, "no verdict rows")
        return _save(fig, path)
    rows = rows.sort_by([("trace", "ascending"), ("capacity", "ascending")])
    trace_R = [str(t) for t in rows["trace"].to_pylist()]
    cap_R = ints(rows, "capacity")
    verdict_R = [str(v) for v in rows["verdict"].to_pylist()]
    rel_R, lo_R, hi_R = (floats(rows, c) for c in ("rel_diff", "ci_lo", "ci_hi"))
    useful_R = [bool(u) for u in rows["in_useful_range"].to_pylist()]
    traces = sorted(set(trace_R))
    caps = np.unique(cap_R)
    code_TC = np.full((len(traces), len(caps)), np.nan)
    for t, c, v, r, u in zip(trace_R, cap_R, verdict_R, rel_R, useful_R, strict=True):
        i, j = traces.index(t), int(np.searchsorted(caps, c))
        code_TC[i, j] = VERDICTS.index(v) if v in VERDICTS else VERDICTS.index("inconclusive")
        text = "n/a" if np.isnan(r) else f"{100 * r:+.1f}%"
        ax_g.text(j, i, text + ("" if u else "*"), ha="center", va="center", fontsize=6)
    ax_g.imshow(
        np.ma.masked_invalid(code_TC),
        cmap=ListedColormap(VERDICT_COLORS),
        vmin=-0.5,
        vmax=len(VERDICTS) - 0.5,
        aspect="auto",
    )
    ax_g.set_xticks(range(len(caps)), [str(c) for c in caps], rotation=90)
    ax_g.set_yticks(range(len(traces)), traces)
    ax_g.set_xlabel("cache capacity (expert slots); * = outside the useful range")
    ax_g.set_title("verdict per cell (text: relative difference of the metric)")
    ax_g.legend(
        handles=[Patch(color=c, label=v) for v, c in zip(VERDICTS, VERDICT_COLORS, strict=True)],
        loc="upper left",
        bbox_to_anchor=(0.0, -0.18),
        ncol=3,
        frameon=False,
    )
    y_R = np.arange(n_cells)[::-1]
    if margin is not None:
        ax_f.axvspan(
            -100 * margin, 100 * margin, color="0.5", alpha=0.15, label=f"±margin ({100 * margin:g}%)"
        )
    ax_f.axvline(0.0, color="k", lw=0.8)
    for y, v, r, lo, hi, u in zip(y_R, verdict_R, rel_R, lo_R, hi_R, useful_R, strict=True):
        if np.isnan(r):
            continue
        color = VERDICT_COLORS[VERDICTS.index(v)] if v in VERDICTS else VERDICT_COLORS[3]
        if not (np.isnan(lo) or np.isnan(hi)):
            ax_f.plot([100 * lo, 100 * hi], [y, y], color=color, lw=2.0, alpha=1.0 if u else 0.4)
        ax_f.plot(100 * r, y, "o", color="k" if u else "0.6", ms=3)
    ax_f.set_yticks(y_R, [f"{t}  C={c}" for t, c in zip(trace_R, cap_R, strict=True)], fontsize=6)
    level = rule.get("confidence")
    ax_f.set_xlabel("relative difference vs baseline (%; lower is better)")
    ax_f.set_title(f"point estimate and {f'{100 * level:g}% ' if level else ''}confidence interval")
    ax_f.grid(axis="x", alpha=0.3)
    if margin is not None:
        ax_f.legend(loc="best")
    return _save(fig, path)


def _grid_panel(ax, rows: list[dict], policies: list[str], split: str, selected: str | None) -> None:
    """One panel of extensions_grid: policies x cells of one split, colour = verdict, text = r (%)."""
    mine = [r for r in rows if r["split"] == split]
    if not mine:
        _note(ax, f"no {split.replace('_', ' ')} cells")
        ax.set_axis_off()
        return

    def column(r):
        return (r["trace"], r["capacity"], r["chosen_on"] if split == "other_workload" else "")

    cols = sorted({column(r) for r in mine})
    code_PC = np.full((len(policies), len(cols)), np.nan)
    for r in mine:
        i, j = policies.index(r["policy"]), cols.index(column(r))
        v = r["verdict"] if r["passes_limits"] else "worse"
        code_PC[i, j] = VERDICTS.index(v) if v in VERDICTS else VERDICTS.index("inconclusive")
        text = "n/a" if r["rel_diff"] is None else f"{100 * r['rel_diff']:+.0f}"
        ax.text(j, i, text + ("" if r["passes_limits"] else "†"), ha="center", va="center", fontsize=6.5)
    ax.imshow(np.ma.masked_invalid(code_PC), cmap=ListedColormap(VERDICT_COLORS), vmin=-0.5,
              vmax=len(VERDICTS) - 0.5, aspect="auto")  # fmt: skip
    fraction = {(r["trace"], r["capacity"]): r.get("capacity_fraction") for r in mine}

    def name(c):
        f = fraction.get((c[0], c[1]))
        pct = "" if f is None else f" ({100 * f:.0f}%)"
        return f"{c[0]} C={c[1]}{pct}" + (f" ← {c[2]}" if c[2] else "")

    ax.set_xticks(range(len(cols)), [name(c) for c in cols], rotation=90, fontsize=6)
    ax.set_yticks(range(len(policies)), [("★ " if p == selected else "") + p for p in policies])
    ax.set_title(split.replace("_", " ") + (" (← the trace the parameters were chosen on)"
                                             if split == "other_workload" else ""))  # fmt: skip


@_styled
def extensions_grid(table: pa.Table | None, decision: dict | None, path: Path) -> Path:
    """The second part at a glance: every judged policy (rows) against the first-part selection at every
    judged cell (columns: trace, capacity), held-out tokens and other workloads side by side; colour =
    verdict, text = relative difference of the estimated time per token in %, † = fails a limit."""
    ext = (decision or {}).get("extensions") or {}
    reference = ext.get("reference", "the first-part selection")
    rows = table.to_pylist() if table is not None else []
    policies = sorted({r["policy"] for r in rows})
    selected = ((decision or {}).get("selected") or {}).get("policy")
    n_cols = len({(r["trace"], r["capacity"], r["split"], r["chosen_on"]) for r in rows})
    fig = _figure(min(max(4.0 + 0.3 * n_cols, 7.0), 18.0), 2.8 + 0.3 * max(len(policies), 1))
    fig.suptitle(
        f"Every judged policy vs the reference {reference}\n(text: r in %, lower is better; ★ selected)"
    )
    if not rows:
        _note(fig.add_subplot(), "no policy was judged")
        return _save(fig, path)
    splits = [s for s in ("held_out", "other_workload") if any(r["split"] == s for r in rows)]
    widths = [max(1, len({(r["trace"], r["capacity"], r["chosen_on"]) for r in rows if r["split"] == s}))
              for s in splits]  # fmt: skip
    axes = fig.subplots(1, len(splits), width_ratios=widths, squeeze=False)[0]
    for ax, split in zip(axes, splits, strict=True):
        _grid_panel(ax, rows, policies, split, selected)
    fig.legend(
        handles=[Patch(color=c, label=v) for v, c in zip(VERDICTS, VERDICT_COLORS, strict=True)],
        loc="outside lower center", ncol=5, frameon=False,
    )  # fmt: skip
    return _save(fig, path)


@_styled
def prefetch_lead(lead: pa.Table | None, trace: str, copy_us: float | None, path: Path) -> Path:
    """Recall of next-layer predictions from adjacent-layer transitions against the lead: in layers and
    in microseconds (d x the shortest layer time), with one expert copy's time marked."""
    fig = _figure(7.0, 4.2)
    ax = fig.add_subplot()
    ax.set_title(f"Inter-layer prefetch: recall vs lead — {trace}")
    rows = select(lead, trace=trace)
    if rows is None or rows.num_rows == 0:
        _note(ax, "no prefetch-lead rows")
        return _save(fig, path)
    rows = rows.filter(pc.is_valid(rows["recall"]))
    lead_us = floats(rows, "lead_us")
    x = lead_us if not np.isnan(lead_us).any() else ints(rows, "lead_layers").astype(float)
    ax.plot(x, floats(rows, "recall"), "o-", label="recall of the predicted K experts")
    for xi, d in zip(x, ints(rows, "lead_layers"), strict=True):
        ax.annotate(f"{d} layer{'s' if d > 1 else ''}", (xi, 0.02), ha="center", fontsize=7)
    if copy_us is not None and not np.isnan(lead_us).any():
        ax.axvline(copy_us, color="r", ls="--", lw=1, label=f"one expert copy ({copy_us:.0f} us)")
    ax.set_xlabel("lead (us; shortest layer time x layers)" if x is lead_us else "lead (layers)")
    ax.set_ylabel("recall")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=7)
    return _save(fig, path)


@_styled
def fidelity_scatter(fidelity: pa.Table | None, path: Path, time_target_pct: float) -> Path:
    """validate's fidelity table (moecache/validation/holdout.py): measured (y) against predicted (x), one
    point per row, time per token and hit rate side by side; a colour per direction (what the profile was
    fitted on -> the workload predicted), filled for a predicted run, hollow for a fitted one (an anchor
    of its profile: priced exactly by construction). The diagonal is a perfect prediction; on the time
    panel the dotted lines are ±`time_target_pct`."""
    fig = _figure(10.0, 4.6)
    ax_t, ax_h = fig.subplots(1, 2)
    panels = (
        (ax_t, "time per token (ms)", "predicted_time_per_token_ms", "measured_time_per_token_ms"),
        (ax_h, "hit rate", "predicted_hit_rate", "measured_hit_rate"),
    )
    if fidelity is None or fidelity.num_rows == 0:
        for ax, title, _, _ in panels:
            ax.set_title(title)
            _note(ax, "no fidelity rows")
        return _save(fig, path)
    direction_R = [str(d) for d in fidelity["direction"].to_pylist()]
    directions = list(dict.fromkeys(direction_R))
    colors = plt.get_cmap("tab10")
    fitted_R = np.array([r == "fitted" for r in fidelity["role"].to_pylist()])
    handles = {}
    for ax, title, x_col, y_col in panels:
        ax.set_title(title)
        ax.set_xlabel("predicted (simulator, the run's own trace)")
        ax.set_ylabel("measured")
        x_R, y_R = floats(fidelity, x_col), floats(fidelity, y_col)
        ok_R = ~np.isnan(x_R) & ~np.isnan(y_R)
        if not ok_R.any():
            _note(ax, "no prediction (no cost profile)" if x_col.endswith("_ms") else "no prediction")
            continue
        for d, name in enumerate(directions):
            mine_R = ok_R & np.array([x == name for x in direction_R])
            color = colors(d % 10)
            for fitted in (False, True):
                sel = mine_R & (fitted_R == fitted)
                if not sel.any():
                    continue
                label = f"{name}, {'fitted' if fitted else 'predicted'}"
                handles[label] = ax.scatter(
                    x_R[sel], y_R[sel], s=22 if fitted else 16, marker="s" if fitted else "o",
                    facecolors="none" if fitted else color, edgecolors=color, linewidths=1.0, label=label,
                )  # fmt: skip
        lo = min(x_R[ok_R].min(), y_R[ok_R].min())
        hi = max(x_R[ok_R].max(), y_R[ok_R].max())
        if x_col.endswith("_ms"):
            if lo > 0 and hi / lo > 10:  # an all-resident run and an all-CPU one: decades apart
                ax.set_xscale("log")
                ax.set_yscale("log")
            line = np.geomspace(lo * 0.9, hi * 1.1, 50) if lo > 0 else np.linspace(0, hi * 1.1, 50)
            ax.plot(line, line, color="0.4", lw=0.8, ls="--")
            for f in (1 - time_target_pct / 100, 1 + time_target_pct / 100):
                ax.plot(line, line * f, color="0.6", lw=0.7, ls=":")
        else:
            pad = 0.02 + 0.05 * (hi - lo)
            ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="0.4", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
    if handles:
        _legend_below(fig, list(handles.values()), ncol=2)
    return _save(fig, path)
