"""`python -m stack.reaper LAUNCHER_PID DATA_DIR`: stops what a hard-killed launcher leaves.

Started by `quilt up` in a session of its own, so a signal to the launcher's group does not reach
it. It waits for the launcher to exit; a launcher that stopped cleanly has removed its record of
processes (`stack.leftovers`), and the reaper just exits; otherwise it stops the recorded
processes (children, embedded Redis and Postgres) and exits.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import psutil

from stack import leftovers

log = logging.getLogger("quilt.reaper")


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    launcher_pid, data_dir = int(argv[0]), Path(argv[1])
    try:
        psutil.Process(launcher_pid).wait()
    except psutil.NoSuchProcess:
        pass
    stopped = leftovers.stop_recorded(data_dir)
    if stopped:
        log.warning("quilt up (pid %d) died without stopping; stopped %s", launcher_pid, ", ".join(stopped))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
