"""Prometheus definitions for kvgate: every metric name, label and bucket lives in `definitions`."""
