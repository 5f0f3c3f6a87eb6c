"""Metric history of a run, written to Parquet."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from raydp.run_directory import RunDirectory


class MetricHistory:
    """Per-step training metrics and per-evaluation held-out metrics."""

    def __init__(self):
        self.train_rows: list[dict] = []
        self.eval_rows: list[dict] = []

    def log_train(self, **row) -> None:
        self.train_rows.append(row)

    def log_eval(self, **row) -> None:
        self.eval_rows.append(row)

    def write(self, directory: Path) -> dict[str, Path]:
        """Write ``train_metrics.parquet`` and ``eval_metrics.parquet`` into ``directory``."""
        run, paths = RunDirectory(directory), {}
        for name, path, rows in (("train_metrics", run.train_metrics, self.train_rows),
                                 ("eval_metrics", run.eval_metrics, self.eval_rows)):
            pq.write_table(pa.Table.from_pylist(rows), path)
            paths[name] = path
        return paths
