"""``python -m swarmavg.peer.cli``: the ``swarmavg`` command without the console script."""

import sys

from swarmavg.peer.cli.main import main

if __name__ == "__main__":  # importing it (e.g. walking the package) runs nothing
    sys.exit(main())
