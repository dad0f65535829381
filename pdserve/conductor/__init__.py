"""The conductor: every decision about the deployment's requests, sans I/O (`conductor_core.ConductorCore` and the
parts and policies it composes: routing, admission, staging, recovery, membership, consumption prediction), and
the control plane's typed messages (`wire`) and command names (`commands`) both clocks share. Pure Python: no
asyncio, sockets, wall clock or torch (tests/test_import_rule.py)."""
