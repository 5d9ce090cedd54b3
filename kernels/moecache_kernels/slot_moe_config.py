"""Launch configurations of `slot_moe` as data: JSON files keyed by E, N (= I), device and dtype.

As vLLM's `fused_moe/configs/`: `configs/E=256,N=512,device_name=NVIDIA_H200,dtype=bfloat16.json` maps a
token count T (a JSON string key) to the block sizes measured fastest for it by
`benchmarks/tune_slot_moe.py`; the entry of the nearest T of the same path is used, if within a factor of
NEAREST_MAX_RATIO of the call's T. With no file for the device and shape,
`default_config` gives a sane one. Two kinds of entry, one per path of the kernel:

- decode (T <= DECODE_MAX_T): {"gate_up": {"BLOCK_I", "BLOCK_H", "num_warps"}, "down": {"BLOCK_H",
    "BLOCK_I", "num_warps"}, "variant"?}; "variant", if present, is one of DECODE_VARIANTS: "two_stage"
    (the default: gate/up launch, then a down launch per (token, block of H) over the token's K experts)
    or "pairs" (the down launch per (pair, block of H), each pair's weighted output to a float32 [T*K, H]
    buffer, then a launch summing a token's K rows: K times the programs, one launch more); the variants
    tried and removed before are in CHANGELOG.md.
- prefill (T > DECODE_MAX_T): {"BLOCK_M", "gate_up": {"BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps",
                               "num_stages"}, "down": {the same keys}, "layout"?, "tma"?}, two optional keys:
    "layout": where the activations and the per-pair float32 down results live. "pairs" (the default when
        absent; what every entry tuned before the key existed ran): row t*K + k, so the down launch gathers
        act rows and scatters its output rows, and the sum reads a token's K adjacent rows. "sorted": row
        = the pair's rank in expert order (slot_moe_align), so a block's act and output rows are contiguous
        and the sum gathers a token's K rows through rank_of_pair.
    "tma": true reads the weights (and, with "sorted", the down launch's act) through tensor descriptors
        (TMA on Hopper; plain loads before it, and in the interpreter) where the tensors allow one, else
        through pointers as false (the default) does. x's rows are gathered through pointers either way.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# Up to this many tokens the decode path runs (one GEMV program per (token, k, block of I)); above it, the
# prefill path sorts (token, k) pairs by expert and runs tensor-core tiles.
DECODE_MAX_T = 16
# A tuned entry is used for token counts within this factor of its own T, else `default_config`: an entry's
# block sizes suit token counts near its T; far below it each expert's few rows are padded to its BLOCK_M
# (a T = 4096 entry, BLOCK_M 128, on a 64-token prefill), which wastes most of every tile.
NEAREST_MAX_RATIO = 4

# the decode's variants (module docstring), the default first; each has the same stages and keys
DECODE_VARIANTS = ("two_stage", "pairs")
DECODE_VARIANT = DECODE_VARIANTS[0]
DECODE_KEYS = {"gate_up": ("BLOCK_I", "BLOCK_H", "num_warps"), "down": ("BLOCK_H", "BLOCK_I", "num_warps")}
PREFILL_STAGE_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
PREFILL_LAYOUTS = ("pairs", "sorted")
DEFAULT_PREFILL_LAYOUT = "pairs"


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16", the dtype part of a config file's name."""
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=16)
def device_name(device: torch.device | str | None = None) -> str:
    """The CUDA device's name with spaces as underscores ("NVIDIA_H200"); "cpu" off CUDA."""
    if torch.device(device or "cuda").type != "cuda" or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(device).replace(" ", "_")


def config_file_name(num_experts: int, inter: int, device: str, dtype: torch.dtype) -> str:
    """`E=256,N=512,device_name=NVIDIA_H200,dtype=bfloat16.json`."""
    return f"E={num_experts},N={inter},device_name={device},dtype={dtype_name(dtype)}.json"


def validate_entry(entry: object, where: str) -> dict:
    """Check one entry's keys and values; raise ValueError naming `where` (file and T) on a bad one."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: want an object, got {entry!r}")
    if "BLOCK_M" in entry:
        if "variant" in entry:
            raise ValueError(f"{where}.variant: only decode entries (no BLOCK_M) have a variant")
        _positive_ints(entry, ("BLOCK_M",), where)
        for stage in ("gate_up", "down"):
            _positive_ints(entry.get(stage), PREFILL_STAGE_KEYS, f"{where}.{stage}")
        if prefill_layout(entry) not in PREFILL_LAYOUTS:
            raise ValueError(f"{where}.layout: want one of {list(PREFILL_LAYOUTS)}, got {entry['layout']!r}")
        if not isinstance(entry.get("tma", False), bool):
            raise ValueError(f"{where}.tma: want true or false, got {entry['tma']!r}")
    else:
        for key in ("layout", "tma"):
            if key in entry:
                raise ValueError(f"{where}.{key}: only prefill entries (with BLOCK_M) have a {key}")
        if entry.get("variant", DECODE_VARIANT) not in DECODE_VARIANTS:
            raise ValueError(
                f"{where}.variant: want one of {list(DECODE_VARIANTS)} or none, got {entry['variant']!r}"
            )
        for stage, keys in DECODE_KEYS.items():
            _positive_ints(entry.get(stage), keys, f"{where}.{stage}")
    return entry


def prefill_layout(entry: dict) -> str:
    """The prefill layout an entry names: "pairs" when it names none."""
    return entry.get("layout", DEFAULT_PREFILL_LAYOUT)


def prefill_tma(entry: dict) -> bool:
    """Whether a prefill entry asks for tensor-descriptor (TMA) loads: false when it says nothing."""
    return entry.get("tma", False)


def _positive_ints(block: object, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(block, dict):
        raise ValueError(f"{where}: want an object with keys {list(keys)}, got {block!r}")
    for key in keys:
        value = block.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{where}.{key}: want a positive integer, got {value!r}")
        if key.startswith("BLOCK_") and value & (value - 1):
            raise ValueError(f"{where}.{key}: want a power of two (Triton block), got {value}")


@functools.lru_cache(maxsize=64)
def load_configs(path: Path) -> dict[int, dict] | None:
    """The T -> entry table of one config file, validated; None when the file does not exist."""
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from err
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path}: want an object mapping token counts to configs")
    table = {}
    for key, entry in raw.items():
        if not key.isdigit() or int(key) <= 0:
            raise ValueError(f"{path}: key {key!r} is not a positive token count")
        table[int(key)] = validate_entry(entry, f"{path.name}[{key}]")
    return table


def default_config(num_tokens: int) -> dict:
    """A config that is sound on any GPU (and in the interpreter): small GEMV blocks for decode, vLLM-like
    bf16 tiles for prefill, larger BLOCK_M as T grows."""
    if num_tokens <= DECODE_MAX_T:
        # Many small programs: at T = 1 the down launch has only T * H / BLOCK_H of them, and fewer than
        # ~4 per SM leave HBM idle (H200, Qwen3.6 shape: BLOCK_H 16 -> 4 took 38.9 -> 25.6 us).
        return {
            "gate_up": {"BLOCK_I": 16, "BLOCK_H": 128, "num_warps": 8},
            "down": {"BLOCK_H": 4, "BLOCK_I": 128, "num_warps": 8},
        }
    block_m = 16 if num_tokens <= 64 else 32 if num_tokens <= 256 else 64
    stage = {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": block_m, "gate_up": dict(stage), "down": dict(stage, BLOCK_N=128)}


@functools.lru_cache(maxsize=1024)
def get_config(
    num_tokens: int,
    num_experts: int,
    inter: int,
    dtype: torch.dtype,
    device: str,
    config_dir: Path = CONFIG_DIR,
) -> dict:
    """The tuned entry of the nearest T in the matching file that is of the same path (decode or
    prefill) as `num_tokens` and within NEAREST_MAX_RATIO of it, else `default_config(num_tokens)`.
    Cached (the launcher calls it on every call): treat the returned dict as read-only."""
    table = load_configs(config_dir / config_file_name(num_experts, inter, device, dtype))
    if table:
        decode = num_tokens <= DECODE_MAX_T
        near = [
            t
            for t in table
            if (t <= DECODE_MAX_T) == decode and max(t, num_tokens) <= NEAREST_MAX_RATIO * min(t, num_tokens)
        ]
        if near:
            return table[min(near, key=lambda t: (abs(t - num_tokens), t))]
    return default_config(num_tokens)
