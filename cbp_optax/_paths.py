"""Paths in parameter and state trees: entries by name (a dict key, an
attribute, an index), joined by slashes (``'Dense_0/kernel'``)."""

from __future__ import annotations

from typing import Any, Sequence


def key_name(key: Any) -> Any:
  """The key of one path entry: a JAX entry's key, name or index, else it."""
  for attribute in ('key', 'name', 'idx'):
    if hasattr(key, attribute):
      return getattr(key, attribute)
  return key


def path_names(path: Sequence[Any]) -> tuple[str, ...]:
  """A path's entries as strings: ``('layers', '0', 'kernel')``."""
  return tuple(str(key_name(key)) for key in path)


def path_str(path: Sequence[Any]) -> str:
  """A path as ``'layers/0/kernel'``: its entries joined by slashes."""
  return '/'.join(path_names(path))
