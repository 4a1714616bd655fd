"""`sil`: partitioned training with synthetic intermediate labels, by concern: options, the
algorithm (`SIL`, the class a library user imports), and the built-in loop's adapter
(registered on import; its cost is the partitioned methods', hvd_lowcomm.methods.partition)."""

from __future__ import annotations

from hvd_lowcomm.methods.sil.adapter import SyntheticIntermediateLabels
from hvd_lowcomm.methods.sil.algorithm import SIL, class_codes, refuse_language_models
from hvd_lowcomm.methods.sil.options import SILOptions

__all__ = ["SIL", "SILOptions", "SyntheticIntermediateLabels", "class_codes", "refuse_language_models"]
