"""Data-parallel attention with expert-parallel MoE: a group of engine processes (group.py), one per
rank (rank.py), whose MoE layers share the routed experts through a dispatcher (dispatch.py)."""

from pdkv.dp.dispatch import AllToAllDispatcher, DispatchError, Dispatcher

__all__ = ["AllToAllDispatcher", "DispatchError", "Dispatcher"]
