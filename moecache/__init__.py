"""moecache: measure, simulate and run Mixture-of-Experts expert offloading policies."""

__version__ = "0.1.0"
__all__ = ["offload"]


def __getattr__(name: str):
    """`moecache.offload` (moecache/offloading.py) is imported on first use: `import moecache` (and
    `moecache --help`) stays free of torch and transformers. The module is not named offload.py: the
    import system would bind the submodule over the function of the same name."""
    if name == "offload":
        from moecache.offloading import offload

        return offload
    raise AttributeError(f"module 'moecache' has no attribute {name!r}")
