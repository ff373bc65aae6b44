"""tf_hwopt: cheaper Keras/TensorFlow training on TPUs and GPUs.

Example:
>>> import tf_hwopt
>>> model.fit(x, y, epochs=20, callbacks=[tf_hwopt.EgeriaCallback()])
"""

# TensorFlow is imported once, here, with its start-up noise hidden; every
# submodule is imported after it.
from tf_hwopt._quiet import import_tensorflow_quietly as _import_tf

_import_tf()

from tf_hwopt import egeria, freezing, hardware, peers, search, training  # noqa: E402
from tf_hwopt.backup import AtomicBackupAndRestore  # noqa: E402
from tf_hwopt.egeria import EgeriaCallback  # noqa: E402
from tf_hwopt.export import ExportResult, export_best, export_saved_model  # noqa: E402
from tf_hwopt.freezing import FreezingCallback, describe_modules  # noqa: E402
from tf_hwopt.hardware import distribute, list_profiles, load_profile  # noqa: E402
from tf_hwopt.peers import FreezeOutCallback, GradientNormFreezeCallback  # noqa: E402
from tf_hwopt.search import (  # noqa: E402
    LatencyAwareBayesianOptimization,
    LatencyAwareHyperband,
    LatencyAwareRandomSearch,
    LatencyAwareTuner,
)
from tf_hwopt.training import TrainingResult, fit_multi_worker, fit_with_cache  # noqa: E402

__version__ = "0.1.0"
