"""Render the analysis, sweep and decision artifacts as one Markdown report with PNG figures."""

from moecache.report.render import render_report

__all__ = ["render_report"]
