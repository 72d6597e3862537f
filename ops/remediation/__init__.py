"""Alert -> drain -> replace: an Alertmanager webhook receiver that heals worker nodes by policy.

    python -m ops.remediation --policy /etc/remediation/policy.yml

Glue, not a scheduler: Prometheus decides a node is bad, Ray moves the work, Ansible rebuilds
the node; this package only maps one to the next under guard rails (policy.py, engine.py).
"""
