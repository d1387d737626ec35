"""The server state machine: its table (pure) and the one writer of `Server.state`."""
