"""The node agent that runs on every GPU server.

It talks only to the fleet API, to NVML/DCGM and to its local engine — never to the database
(docs/design.md, "The parts"; docs/agent.md). Ansible installs it from the project's wheel
(ansible/, docs/ansible.md).
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

# The installed distribution's version: what a rolling upgrade (ansible/) waits to see reported.
try:
    AGENT_VERSION = _version("fleet")[:32]
except PackageNotFoundError:  # run from a source tree that was never installed
    AGENT_VERSION = "0+unknown"
