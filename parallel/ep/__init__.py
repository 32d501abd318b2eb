"""Expert parallelism: dispatchers (all-to-all, hierarchical node-limited) and ``apply_ep``."""
from .apply import DISPATCHERS, apply_ep, is_expert_param
from .dispatch import AllToAllDispatcher, DispatchStats, HierarchicalDispatcher

__all__ = ["DISPATCHERS", "apply_ep", "is_expert_param", "AllToAllDispatcher", "HierarchicalDispatcher", "DispatchStats"]
