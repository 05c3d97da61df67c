"""The service around a deployment: HTTP API, CLI client, autoscaler, hooks, metrics, logs, input pre-flight checks."""
