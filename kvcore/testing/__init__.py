"""Test support for code built on kvcore — the checks kvcore's own tests use, for yours.

* :func:`checked` / :func:`unchecked` / :func:`assert_no_leak`: a KVCacheManager that checks its
  invariants (and, with ``track_contents``, the KV each hit and table holds) after every public
  call, the end-of-test leak check, and :func:`step_failed` to report a step the engine failed;
* inspection: :func:`check_invariants` (a pool), :func:`check_manager_invariants` (a manager),
  :func:`add_construction_hook` (a function called with every manager built from now on);
* :class:`ContentOracle`: what every KV slot holds, tracked without hashes;
* fault injection: :class:`CollidingHasher`, :class:`PlantedCollisions`,
  :func:`refuse_allocation`, :class:`ManualClock`;
* :class:`~kvcore.testing.driver.HostileDriver` and :data:`~kvcore.testing.setups.SETUPS`: the
  valid-and-hostile operation driver behind kvcore's fuzzing;
  :class:`~kvcore.testing.scheduler_driver.SchedulerDriver`: the same one level up, kvcore's
  scheduler with a KV connector whose loads fail (``python -m kvcore.bench fuzz --scheduler``);
* with ``hypothesis`` installed (``pip install kvcore[testing]``):
  :mod:`kvcore.testing.strategies` and :class:`kvcore.testing.machine.SchedulerMachine`, a state
  machine that drives *your* scheduler.
* the pytest plugin (``pytest --kvcore-check``, fixture ``kv_manager``) is
  :mod:`kvcore_pytest.plugin`.

Importing this package imports neither hypothesis nor pytest.
"""

from kvcore.invariants import check_invariants, check_manager_invariants
from kvcore.manager import add_construction_hook
from kvcore.testing.checked import assert_no_leak, checked, is_checked, step_failed, unchecked
from kvcore.testing.faults import (
    COLLISION_MODES,
    CollidingHasher,
    ManualClock,
    PlantedCollisions,
    refuse_allocation,
)
from kvcore.testing.oracle import ContentOracle, WrongKVError

__all__ = ["COLLISION_MODES", "CollidingHasher", "ContentOracle", "ManualClock",
           "PlantedCollisions", "WrongKVError", "add_construction_hook", "assert_no_leak",
           "check_invariants", "check_manager_invariants", "checked", "is_checked",
           "refuse_allocation", "step_failed", "unchecked"]
