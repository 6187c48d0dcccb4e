"""The background thread that draws pair plots during the session (see plot_cache.py)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from convergence.report.formats.plot_cache import plot_key
from convergence.report.formats.plots import plot_pair
from convergence.run.outcome import PairOutcome


class PlotPrerenderer:
    """One background thread drawing pair plots into ``cache_dir`` as outcomes come in.

    One thread, never more: matplotlib figures are not shared between threads here, and the
    report (which draws what is missing) runs only after :meth:`wait`.
    """

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future[None]] = []
        self._lock = threading.Lock()

    def submit(self, outcome: PairOutcome) -> None:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plots")
            self._futures.append(self._pool.submit(self._draw, outcome))

    def _draw(self, outcome: PairOutcome) -> None:
        path = self.cache_dir / f"{plot_key(outcome)}.png"
        if path.is_file():
            return
        try:
            plot_pair(outcome, path)
        except Exception:  # noqa: BLE001 -- the report draws it again and reports the error
            path.unlink(missing_ok=True)

    def wait(self) -> None:
        """Block until every submitted plot is drawn (or given up)."""
        with self._lock:
            futures, self._futures = self._futures, []
            pool, self._pool = self._pool, None
        for future in futures:
            future.result()
        if pool is not None:
            pool.shutdown(wait=True)
