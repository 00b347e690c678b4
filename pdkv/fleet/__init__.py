"""Fleet mode (docs/FLEET.md): membership on etcd (registry.py over the small v3 client in
etcd.py), draining (drain.py), SLO-aware admission (admission.py)."""
