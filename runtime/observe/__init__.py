"""What a run shows: MLflow tracking, the Prometheus exporter, the console progress line, cost and the run report."""
