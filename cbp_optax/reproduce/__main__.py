"""``python -m cbp_optax.reproduce``: same as ``cbp-optax reproduce``."""

import sys

from cbp_optax.reproduce.cli import main

if __name__ == '__main__':
  sys.exit(main())
