"""Self-contained HTML reports of a study or a single run (``raydp report DIR``)."""

from raydp.report.page import write_report

__all__ = ["write_report"]
