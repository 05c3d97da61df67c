"""The core vocabulary: phases, the state machine, typed errors, the worker protocol, rank mappings, timeouts."""
