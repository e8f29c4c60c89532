"""The expert cache: slot memory (mechanism) and eviction policy (plain Python, shared with the simulator)."""
