"""The control plane: the coordinator that runs operations as plans, and the pure decisions (plans)."""
