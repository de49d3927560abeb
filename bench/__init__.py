"""Benchmarks for strata, run with ``make bench`` (``python -m bench``)."""
