"""vLLM's own unit tests as kvcore's conformance suite (``scripts/vllm_conformance.sh VERSION``).

* ``files.txt``: the vLLM test files (globs), one a line;
* ``exceptions/VERSION.toml``: the tests that pass stock and fail with kvcore, each with the
  cause, grouped by cause;
* :mod:`~kvcore_pytest.vllm_conformance.plugin`: loaded into vLLM's pytest (``-p``) in both
  runs; swaps in kvcore's scheduler classes (``--kvcore-schedulers``) and records outcomes
  and the schedulers each test built;
* :mod:`~kvcore_pytest.vllm_conformance.hf_cache`: the Hugging Face configs the tests read,
  generated, served offline;
* :mod:`~kvcore_pytest.vllm_conformance.run`: runs both passes and gives the verdict.

vLLM's test files are never part of kvcore: ``scripts/vllm_tests.sh`` fetches them from the
release's source distribution at run time.
"""
