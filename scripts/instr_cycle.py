"""One ``kvcore bench manager`` scenario's timed loop, once, for ``scripts/instr_counts.sh``.

Usage: ``PYTHON scripts/instr_cycle.py WORKLOADS_DIR INDEX REQUESTS``.  ``WORKLOADS_DIR`` is a copy
of this tree's ``kvcore/bench/workloads`` (the script imports it as the package ``workloads``),
so a baseline interpreter runs exactly the same loop as this tree's; only the kvcore it imports
differs.  The requests are built (and hashed, unless the scenario times hashing) before the
loop; the garbage collector is off during the loop, as in the bench's timing.  Prints the
scenario's name and what the loop did (hit tokens, preemptions), which must agree between the
two interpreters.
"""

from __future__ import annotations

import gc
import sys


def main() -> None:
    workloads_dir, index, requests = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sys.path.insert(0, workloads_dir)
    from workloads.manager_cycle import SCENARIOS, build_loop  # this tree's copy, path above

    sc = SCENARIOS[index]
    loop = build_loop("kvcore", sc, sc.num_requests(requests))
    gc.collect()
    gc.disable()
    did = loop()
    gc.enable()
    print(f"{sc.name}\t{did}")


if __name__ == "__main__":
    main()
