"""Run output: the run directory's files, statistics, tables, plots and comparisons."""

from __future__ import annotations

from ula_jax.report.compare import Comparison, compare_runs
from ula_jax.report.output import (CONFIG_FILE, METRICS_FILE, REQUESTS_FILE, RUN_PLOT,
                                   SUMMARY_FILE, MetricsWriter, RunDirError, new_run_dir,
                                   read_metrics, read_summary, write_outputs,
                                   write_requests, write_summary)
from ula_jax.report.progress import RunProgress
from ula_jax.report.stats import aggregate_extra, request_record, run_stats
from ula_jax.report.tables import compare_table, summary_table, sweep_table

__all__ = [
    "CONFIG_FILE", "METRICS_FILE", "REQUESTS_FILE", "RUN_PLOT", "SUMMARY_FILE",
    "Comparison", "MetricsWriter", "RunDirError", "RunProgress", "aggregate_extra", "compare_runs",
    "compare_table", "new_run_dir", "read_metrics", "read_summary", "request_record",
    "run_stats", "summary_table", "sweep_table", "write_outputs", "write_requests",
    "write_summary",
]
