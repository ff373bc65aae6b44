"""Egeria: knowledge-guided layer freezing for Keras (EuroSys 2023).

The Egeria-specific parts, in the order data flows through them:
`reference` (the int8 reference model, through TFMOT), `plasticity` (the SP
loss), `policy` (the freeze decision), `callback` (`EgeriaCallback`) and
`plot`. The module partition, the engine and the base callback are the
freezing core (`tf_hwopt.freezing`); the drivers are in `tf_hwopt.training`.
The names of those re-exported here are kept for code written against
earlier versions.
"""

from tf_hwopt.egeria.callback import EgeriaCallback
from tf_hwopt.egeria.plasticity import sp_loss
from tf_hwopt.egeria.plot import plot
from tf_hwopt.egeria.policy import EgeriaPolicy, relative_slope
from tf_hwopt.egeria.reference import Reference, ReferenceBuild, ReferenceUnavailable, quantize_int8_per_channel

# Kept importable from here (they moved to the freezing core, the peers and the drivers).
from tf_hwopt.freezing import (  # noqa: F401
    ActivationReader,
    Decision,
    FreezingCallback,
    FreezingEngine,
    Module,
    describe_modules,
    draw_probe,
    partition_modules,
)
from tf_hwopt.peers import FreezeOutCallback, GradientNormFreezeCallback  # noqa: F401
from tf_hwopt.training import ActivationCache, fit_multi_worker, fit_with_cache  # noqa: F401
