"""The peer policies Egeria is measured against, on the same freezing core.

`freezeout` (FreezeOut / Composer's `LayerFreezing`: a fixed schedule) and
`gradnorm` (AutoFreeze / PipeTransformer: gradient-norm change rate).
"""

from tf_hwopt.peers.freezeout import FreezeOutCallback, FreezeOutPolicy, freezeout_schedule
from tf_hwopt.peers.gradnorm import GradientNormFreezeCallback, GradientNormPolicy, gradient_norm_change_rate
