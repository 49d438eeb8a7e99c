"""``python -m cbp_optax_experiments.reproduce``: ``cbp-optax reproduce``."""

import sys

from cbp_optax_experiments.reproduce.cli import main

if __name__ == '__main__':
  sys.exit(main())
