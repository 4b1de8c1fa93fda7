"""What both front doors serve for operators: /health, /livez, /metrics, /debug and /admin, and
the request id and request metrics.
"""
