"""Benchmarks: an open-loop harness, the PostgreSQL baseline and the report (JSON -> PNG + Markdown)."""
