"""Alerts and dashboards for kubetitan, generated from code (see docs/monitoring.md).

- ``config``      selectors and thresholds (one place)
- ``queries``     the PromQL of every dashboard panel
- ``alerts``      Prometheus alerting rules (also the chart's PrometheusRule)
- ``dashboards``  Grafana dashboards (one panel constructor)

``charts/generate.py`` writes them into the chart; tests check for drift.
"""
