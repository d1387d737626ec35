"""What agents report, and the routing table routers read."""
