"""Scheduled Prefect deployments of the pipeline: `scheduled.py` (the flow a firing runs), `deploy.py` (register / serve it)."""
