"""The virtual colo's hardware: real BMC emulators (sushy-tools, ipmi_sim) started as child
processes on 127.0.0.1, and the colo (`colo.py`, `fleetctl lab`) that hangs simulated GPU
servers (an agent with simulated GPUs and stand-in engines) off their power buttons. Tests use
the emulators as real protocol peers."""
