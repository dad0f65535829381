"""Workers, the conductor (routing, admission) and the launcher of a pdserve deployment."""
