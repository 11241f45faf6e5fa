"""Governance for qag: decide once, when a plan is built, whether a statement may run for a key and how each
output column is masked; apply the masks per call. Pure library: no I/O (columns come from a callback)."""

from .analysis import Analysis, analyze
from .errors import GovernanceError
from .plan import GovernedPlan, MaskRule, parse_rules, plan_governance
from .transforms import apply_transforms, compile_transforms, hash_value, mask_value, text_of

__all__ = [
    "Analysis", "GovernanceError", "GovernedPlan", "MaskRule", "analyze", "apply_transforms",
    "compile_transforms", "hash_value", "mask_value", "parse_rules", "plan_governance", "text_of",
]
