"""What happened: the per-request record, Prometheus metrics, the access log, the dashboard's window.
Imports only the base modules (errors, config)."""
