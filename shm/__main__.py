"""`python -m shm stat <name>`: print a segment's state as JSON (the same data as `qag shm stat`)."""
from __future__ import annotations

import json
import sys

from .segment import LayoutError, Segment


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "stat":
        print("usage: python -m shm stat /qag-<hash>   (vectors: python -m shm.vectors)", file=sys.stderr)
        return 2
    try:
        seg = Segment.attach(argv[1])
    except LayoutError as e:
        print(f"shm: {e}", file=sys.stderr)
        return 1
    try:
        print(json.dumps(seg.stat(), indent=2))
    finally:
        seg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
