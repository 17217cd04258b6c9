"""The processes kvcore starts, and what they may listen on.

* :mod:`kvcore.proc.lifeline`: every child process kvcore starts ends with the kvcore process
  that started it, however that process ends (an exception, SIGTERM, SIGHUP, SIGKILL).
* :mod:`kvcore.proc.loopback`: runs a Python program whose native library binds every interface
  (NVIDIA Dynamo's indexer) with those binds moved to one address, loopback by default.

Both files also run as scripts, by path, before the program they start: they import nothing
from kvcore (whose import takes seconds), and their directory holds no module that could shadow
one of the standard library.
"""
