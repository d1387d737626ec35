"""The node agent that runs on every GPU server.

It talks only to the fleet API, to NVML/DCGM and to its local engine — never to the database
(docs/design.md, "The parts"). The daemon itself arrives with the agent issues; this package
exists now so the layout, packaging and imports are settled from the first day.
"""

AGENT_VERSION = "0.1.0"
