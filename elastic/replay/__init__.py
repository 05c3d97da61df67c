"""Scenario files, the replayer that runs them on real workers, and its reports and plots."""
