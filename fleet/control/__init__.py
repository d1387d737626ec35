"""Leadership and the singleton control loops the service runs."""
