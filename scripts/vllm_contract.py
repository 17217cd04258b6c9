"""Print the contract kvcore's adapter relies on, read from the installed vLLM, as the Python
literal ``kvcore/integrations/vllm/contract.py`` records per version (``_CALLS``, ``_NAMES``,
``_EVENTS`` entries).  Run it with each supported vLLM's interpreter after checking the adapter
against that version:

    VLLM_TARGET_DEVICE=cpu .vllm033-venv/bin/python scripts/vllm_contract.py
"""

from __future__ import annotations

from vllm.version import __version__

from kvcore.integrations.vllm.contract import capture, load_surface


def main() -> None:
    contract = capture(load_surface())
    print(f"# vLLM {__version__}")
    print("calls = {")
    for call, params in contract.calls.items():
        print(f"    {call!r}: (")
        for p in params:
            print(f"        {p!r},")
        print("    ),")
    print("}")
    print("names = {")
    for cls, names in contract.names.items():
        print(f"    {cls!r}: frozenset({sorted(names)!r}),")
    print("}")
    print("events = {")
    for event, names in contract.events.items():
        print(f"    {event!r}: {names!r},")
    print("}")


if __name__ == "__main__":
    main()
