"""Egeria: knowledge-guided layer freezing for Keras (EuroSys 2023).

The parts, in the order data flows through them: `modules` (partition into
front-to-back modules), `reference` (int8 reference model via TFMOT),
`plasticity` (SP loss on a probe batch), `policy` (the freeze decision),
`freezing` (the engine that freezes and rebuilds the train function) and
`callback` (`EgeriaCallback`, which ties them into `model.fit`). `cache`
(`fit_with_cache`) skips the frozen prefix's forward pass too;
`multiworker` (`fit_multi_worker`) trains on several hosts. `freezeout` and
`gradnorm` are the peer policies, on the same engine.
"""

from tf_hwopt.egeria.cache import ActivationCache, fit_with_cache
from tf_hwopt.egeria.callback import EgeriaCallback
from tf_hwopt.egeria.freezing import FreezingEngine
from tf_hwopt.egeria.freezing_callback import FreezingCallback
from tf_hwopt.egeria.freezeout import FreezeOutCallback, freezeout_schedule
from tf_hwopt.egeria.gradnorm import GradientNormFreezeCallback, GradientNormPolicy, gradient_norm_change_rate
from tf_hwopt.egeria.multiworker import fit_multi_worker
from tf_hwopt.egeria.modules import Module, describe_modules, partition_modules
from tf_hwopt.egeria.plasticity import ActivationReader, draw_probe, module_plasticity, sp_loss
from tf_hwopt.egeria.plot import plot
from tf_hwopt.egeria.policy import Decision, EgeriaPolicy, relative_slope
from tf_hwopt.egeria.reference import Reference, quantize_int8_per_channel
