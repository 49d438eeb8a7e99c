"""Figures and output files of the reproduction suite.

Every study writes ``<out>/<study>/``: ``results.md`` (the table), ``results.json``
(raw per-seed numbers) and PNG figures. matplotlib runs headless (Agg).
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, Optional, Sequence

import numpy as np

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

# Small PNGs: they are committed to docs/reproduction/.
DPI = 90
FIGSIZE = (5.6, 3.6)


def _jsonable(value: Any) -> Any:
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, np.ndarray):
    return _jsonable(value.tolist())
  if isinstance(value, (np.floating, float)):
    value = float(value)
    return value if math.isfinite(value) else None
  if isinstance(value, np.integer):
    return int(value)
  if isinstance(value, np.bool_):
    return bool(value)
  return value


def write_json(path: pathlib.Path, payload: dict[str, Any]) -> None:
  """JSON with non-finite numbers (diverged or censored runs) as ``null``."""
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(_jsonable(payload), indent=1) + '\n')


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub markdown table; the first column left-aligned, others right."""
  lines = ['| ' + ' | '.join(str(h) for h in header) + ' |',
           '|' + '|'.join([':---'] + ['---:'] * (len(header) - 1)) + '|']
  lines += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
  return '\n'.join(lines)


def write_markdown(path: pathlib.Path, title: str, sections: Sequence[str]) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(f'# {title}\n\n' + '\n\n'.join(sections) + '\n')


def band(ax, x, runs: np.ndarray, label: str, color: Optional[str] = None,
         **kwargs) -> None:
  """Median over the first axis with the shaded interquartile range."""
  runs = np.asarray(runs, np.float64)
  low, mid, high = np.nanpercentile(runs, [25, 50, 75], axis=0)
  line, = ax.plot(x, mid, label=label, color=color, **kwargs)
  ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2, lw=0)


def new_axes(nrows: int = 1, ncols: int = 1, **kwargs):
  figsize = (FIGSIZE[0] * ncols, FIGSIZE[1] * nrows)
  return plt.subplots(nrows, ncols, figsize=figsize, **kwargs)


def save(fig, path: pathlib.Path) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=DPI)
  plt.close(fig)
