"""How state moves: the reconfiguration planner, each host's work, byte-level
resharding, and repair plans. Pure functions."""
