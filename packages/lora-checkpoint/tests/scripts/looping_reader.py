"""A reader for the pruning test: ``load(root)`` again and again until ``STOP_FILE`` exists.

Usage: ``looping_reader.py ROOT STOP_FILE``. Prints ``OK <name>`` for every load and
``FAIL <type>: <message>`` for every exception; ``DONE`` at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import lora_checkpoint as lc


def main() -> None:
    root, stop = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    print("READY", flush=True)
    while not stop.exists():
        if not (root / "latest").exists():
            continue
        try:
            loaded = lc.load(root)
            print(f"OK {loaded.manifest.name}", flush=True)
        except Exception as exc:  # the test counts every failure, of any type
            print(f"FAIL {type(exc).__name__}: {' '.join(str(exc).split())}", flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
