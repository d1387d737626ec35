"""Fleet's pure core, shared by the service, the agent, the router and the simulator.

It imports nothing of ours (an import contract, pyproject.toml) and does no I/O."""
