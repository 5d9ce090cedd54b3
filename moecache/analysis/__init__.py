"""Offline sequence analysis of routing traces (`moecache analyze`)."""
