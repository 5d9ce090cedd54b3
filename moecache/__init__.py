"""moecache: measure, simulate and run Mixture-of-Experts expert offloading policies."""

__version__ = "0.1.0"
