"""Trellis's HTTP servers: one small server (server.py) under the metrics and health endpoint
(metrics.py) and the live fabric page (fabric_page.py, web/)."""
