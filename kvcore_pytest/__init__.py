"""kvcore's pytest plugin, registered under the ``pytest11`` entry point ``kvcore``.

It lives outside the ``kvcore`` package so that loading it (pytest loads every installed plugin)
imports nothing of kvcore, torch or hypothesis until a test asks for its checks: see
:mod:`kvcore_pytest.plugin`.
"""
