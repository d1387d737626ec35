"""The virtual colo's hardware: real BMC emulators (sushy-tools, ipmi_sim) started as child
processes on 127.0.0.1. Tests use them as real protocol peers; the lab (a later issue) hangs
simulated GPU servers off their power buttons."""
