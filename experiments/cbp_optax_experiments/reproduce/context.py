"""What every study receives from the command line, and what it hands back."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class StudyContext:
  """Options of ``cbp-optax reproduce``.

  Attributes:
    out: the study's own output folder (``<--out>/<study>``).
    seeds: seeds per configuration; None for the paper's count.
    quick: the reduced smoke-test version (under a minute on 2 cores).
    data_dir: where the real-data studies look for MNIST / CIFAR-10.
    data: the transformer study's text (a file or a folder); None for the
      Python standard library.
    progress: show tqdm progress bars.
  """
  out: pathlib.Path
  seeds: Optional[int] = None
  quick: bool = False
  data_dir: Optional[pathlib.Path] = None
  data: Optional[pathlib.Path] = None
  progress: bool = True

  def seed_count(self, paper: int, quick: int) -> int:
    if self.seeds is not None:
      return self.seeds
    return quick if self.quick else paper


@dataclasses.dataclass
class StudyResult:
  """A study's headline numbers (also in its JSON) and its wall time."""
  name: str
  summary: dict[str, Any]
  seconds: float = 0.0
