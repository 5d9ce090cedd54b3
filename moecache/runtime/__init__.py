"""The offloading runtime: pinned expert store, slot pool, transfer engine and cache manager (docs/runtime.md)."""
