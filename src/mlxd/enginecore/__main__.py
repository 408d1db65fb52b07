"""``python -m mlxd.enginecore RUN_DIR EPOCH``: the engine-core process (see core.py)."""

import sys

from mlxd.enginecore.core import main

if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
