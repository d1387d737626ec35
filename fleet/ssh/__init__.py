"""SSH from the fleet to its servers' OS (paramiko): host keys pinned per server (hostkeys),
commands and the graceful reboot (client), and diagnostic bundles (diagnose). docs/ansible.md.
"""
